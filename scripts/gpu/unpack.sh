#!/usr/bin/env bash
# On the GPU machine: unpack carried chunks of the GPU bundle (scripts/gpu/pack.py) into one tree.
# usage: scripts/gpu/unpack.sh chunk-1 [chunk-2 ...]   (each .gpu-bundle/CHUNK carried by this command)
# Every archive is checked against scripts/gpu/manifest.json before it is unpacked; Python packages go
# to $KVALIGN_GPU_SITE (default /tmp/site), Debian packages to $KVALIGN_GPU_DEBS (default /tmp/kvalign-debs).
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=${KVALIGN_GPU_SITE:-/tmp/site}
DEBS=${KVALIGN_GPU_DEBS:-/tmp/kvalign-debs}
mkdir -p "$SITE" "$DEBS"
for chunk in "$@"; do
  python3 - "$chunk" <<'PY'
import hashlib, json, pathlib, sys
chunk = sys.argv[1]
m = json.loads(pathlib.Path("scripts/gpu/manifest.json").read_text())
want = {d["archive"]: d["archive_sha256"] for d in m["distributions"] if d["chunk"] == chunk}
want |= {d["file"]: d["sha256"] for d in m["debs"] if d["chunk"] == chunk}
have = {p.name: p for p in pathlib.Path(".gpu-bundle", chunk).glob("*")}
missing = sorted(set(want) - set(have))
bad = sorted(n for n in want if n in have and hashlib.sha256(have[n].read_bytes()).hexdigest() != want[n])
if not want or missing or bad:
    sys.exit(f"unpack {chunk}: not in the manifest" if not want else f"unpack {chunk}: missing {missing}, checksum off {bad}")
PY
  for f in .gpu-bundle/"$chunk"/*.tar.xz; do tar -xJf "$f" -C "$SITE"; done
  for f in .gpu-bundle/"$chunk"/*.deb; do [ -e "$f" ] && dpkg -x "$f" "$DEBS"; done
  touch "$SITE/.kvalign-$chunk"
  echo "unpacked $chunk into $SITE"
done
