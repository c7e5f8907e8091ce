"""Build the GPU bundle: everything the GPU machine lacks for kvalign's live layer, in carry-sized chunks.

The GPU machine (one H100, Python 3.12, torch 2.11.0+cu130, no package registry) has torch, Triton,
numpy, transformers' own dependencies and CUDA; it lacks SGLang, its CUDA kernels, Dynamo and the
server stack. Files reach it only as part of one command's carry (64 MiB with the working tree), and
it is given back after 30 s idle, so the bundle is a few chunks carried by commands made back to back
and unpacked into one ``--target`` tree (``/tmp/site``) that goes first on ``PYTHONPATH``.

What it does, from the pinned list ``scripts/gpu/requirements-gpu.txt`` (name==version, cp312):

1. ``pip download`` the cp312 manylinux wheels (cached in ``--wheels``);
2. ``pip install --no-deps --target`` them into one staging tree, as Python 3.12 on x86-64 would;
3. trim what the live layer never loads (:data:`TRIMS`): ``sglang-kernel``'s other architectures and
   its 1 GB FA3 ``flash_ops`` (the live layer runs SGLang's triton attention), SGLang's
   ``multimodal_gen`` and test trees, Dynamo's ``_core.abi3.so`` symbol tables (``strip``), and NIXL EP
   (``nixl_ep_cu13``, built for torch 2.12+ only; SGLang's NIXL transfer uses UCX and the bindings);
4. take out what ``pip install`` wrote about *this* install (:func:`normalize`): ``direct_url.json``
   names the wheel's absolute path, and ``RECORD`` hashes it and the console scripts, whose shebang
   is this machine's interpreter; ``RECORD`` is written again from the files that travel;
5. pack each distribution's files as one reproducible ``tar.xz`` (:func:`pack`: sorted names, mtime
   0, owner 0/0 unnamed, mode 0644 or 0755, PAX), and place the archives into chunks of at most
   :data:`CHUNK_LIMIT` bytes (largest first), so that a chunk plus the working tree fits one
   command's carry;
6. write ``scripts/gpu/manifest.json`` (committed): each distribution's name, version, wheel
   SHA-256, archive SHA-256 and size, and chunk, the tools that shaped bytes (``built_with``) and
   the fields those tools make machine-dependent (``machine_dependent``, :data:`MACHINE_DEPENDENT`).
   ``tests/unit/suite/test_gpu_bundle.py`` holds it, and packs a wheel twice from two paths.

Reproducible: the same wheels give the same archives on another machine, whatever the wheel
directory, the staging directory, the umask or the clock, except where a tool's own release shapes
the bytes (:data:`MACHINE_DEPENDENT`): ``strip`` (binutils) rewrites ``ai-dynamo-runtime``'s shared
object, and ``apt-get download`` takes the mirror's current ``libssl-dev``.

``scripts/gpu/unpack.sh`` is the other half, run on the GPU machine.

Usage: ``python3 scripts/gpu/pack.py [--out .gpu-bundle] [--wheels ~/.cache/kvalign/gpu-wheels]`` (the
index is asked only for pins whose wheel is not in ``--wheels`` yet). ``--verify`` packs the pinned wheels
found in ``--wheels`` (all or some: another machine gets them a carry at a time) and holds each archive
against the committed manifest (:func:`verify`), writing nothing: how a second machine shows the claim.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
REQUIREMENTS = HERE / "requirements-gpu.txt"
MANIFEST = HERE / "manifest.json"

PYTHON_VERSION = "3.12"
#: Tags pip may take for the device's CPython 3.12 on x86-64 (glibc 2.35 or newer there).
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
MIB = 1 << 20
#: What one device command carries at most (the working tree included), and the room left for the tree.
CALL_LIMIT = 64 * MIB
TREE_ROOM = 8 * MIB
CHUNK_LIMIT = CALL_LIMIT - TREE_ROOM

#: Extra Debian packages unpacked beside the tree (``dpkg -x``): OpenSSL's headers, which SGLang's
#: KV-event hash extension (``mem_cache/cpp_utils/hash_binding.cpp``, JIT-built on first use) needs
#: where the device image has none. The version is this machine's Debian's; only headers are used.
DEBS = ("libssl-dev",)


#: Files ``pip install`` writes beside a distribution that describe the install, not the package:
#: ``direct_url.json`` holds the wheel's ``file://`` path. Dropped (``INSTALLER`` "pip" and the empty
#: ``REQUESTED`` are the same on every machine and stay).
INSTALL_RECORDS = ("direct_url.json",)

#: Manifest fields another machine may build differently from the same wheels, and why.
MACHINE_DEPENDENT = {
    "distributions[ai-dynamo-runtime].archive_sha256, .archive_bytes":
        "strip --strip-unneeded rewrites dynamo/_core.abi3.so; its output follows the binutils release "
        "(built_with.strip)",
    "debs[*] (version, file, bytes, sha256)": "apt-get download takes the Debian mirror's current libssl-dev",
    "chunks[*].bytes, and a chunk assignment": "sums of the sizes above; an archive may move chunk if they change",
}


@dataclass(frozen=True)
class Trim:
    """Paths (relative to the tree) of one distribution that the live layer never loads."""

    drop_prefixes: tuple[str, ...] = ()
    keep_only_so: tuple[str, ...] | None = None  # of the distribution's .so files, only these
    strip: tuple[str, ...] = ()  # shared objects whose symbol tables are stripped
    why: str = ""


TRIMS: dict[str, Trim] = {
    "sglang-kernel": Trim(
        keep_only_so=("sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/spatial_ops.abi3.so"),
        why="Hopper (sm90) common ops only: FA3 flash_ops (1.1 GB), FlashMLA, InfLLM and sm100 are never loaded "
            "with --attention-backend triton"),
    "sglang": Trim(
        drop_prefixes=("sglang/multimodal_gen/", "sglang/test/", "sglang/benchmark/",
                       "sglang/srt/rust_extensions/_bench."),
        why="diffusion models, SGLang's own tests and benchmarks: not imported by the text server"),
    "ai-dynamo-runtime": Trim(strip=("dynamo/_core.abi3.so",), why="symbol tables (216 MiB -> ~80 MiB raw)"),
    "nixl-cu13": Trim(
        drop_prefixes=("nixl_ep_cu13/",),
        why="NIXL EP (expert-parallel all-to-all, 91 MiB): built for torch 2.12-2.14 only, never loaded by "
            "SGLang's KV transfer; UCX, the UCX plugin and the bindings stay"),
}


@dataclass
class Dist:
    name: str
    version: str
    wheel: Path
    files: list[str] = field(default_factory=list)  # relative to the staging tree


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def read_requirements(path: Path = REQUIREMENTS) -> dict[str, str]:
    """name -> version from ``name==version`` lines (comments and blank lines ignored)."""
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version.strip():
            raise SystemExit(f"{path.name}: every line pins one version (name==version), got {raw!r}")
        pins[canonical(name.strip())] = version.strip()
    return pins


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tool_version(argv: list[str]) -> str:
    """The first line ``argv`` prints (a tool's ``--version``), or why there is none."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"unavailable ({exc})"
    return out.splitlines()[0].strip() if out.strip() else "unavailable (no output)"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def platform_args() -> list[str]:
    out = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for plat in PLATFORMS:
        out += ["--platform", plat]
    return out


def local_wheels(pins: dict[str, str], wheels: Path) -> dict[str, Path]:
    """The pins whose wheel is already in ``wheels``."""
    found: dict[str, Path] = {}
    for whl in sorted(wheels.glob("*.whl")):
        name, version = whl.name.split("-")[:2]
        if pins.get(canonical(name)) == version:
            found[canonical(name)] = whl
    return found


def download(pins: dict[str, str], wheels: Path) -> dict[str, Path]:
    """The wheel of each pin (downloaded once into ``wheels``; the index is not asked when all are there)."""
    wheels.mkdir(parents=True, exist_ok=True)
    absent = {n: v for n, v in pins.items() if n not in local_wheels(pins, wheels)}
    if absent:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
            req.write("".join(f"{n}=={v}\n" for n, v in absent.items()))
        try:
            pip("download", "--no-deps", *platform_args(), "-d", str(wheels), "-r", req.name)
        finally:
            os.unlink(req.name)
    found = local_wheels(pins, wheels)
    missing = sorted(set(pins) - set(found))
    if missing:
        raise SystemExit(f"no cp{PYTHON_VERSION.replace('.', '')} wheel downloaded for: {', '.join(missing)}")
    return found


def install(wheels: dict[str, Path], stage: Path) -> None:
    pip("install", "--no-deps", "--no-compile", *platform_args(), "--target", str(stage), *map(str, wheels.values()))


def dist_files(stage: Path, pins: dict[str, str], wheels: dict[str, Path]) -> list[Dist]:
    """Each pinned distribution with the files its RECORD lists (paths inside ``stage``)."""
    dists = []
    for info in sorted(stage.glob("*.dist-info")):
        name, version = info.name[: -len(".dist-info")].rsplit("-", 1)
        key = canonical(name)
        if key not in pins:
            continue
        files = []
        for line in (info / "RECORD").read_text().splitlines():
            rel = line.rsplit(",", 2)[0]
            if rel and not rel.startswith("..") and (stage / rel).is_file():
                files.append(rel)
        dists.append(Dist(key, version, wheels[key], sorted(set(files))))
    missing = sorted(set(pins) - {d.name for d in dists})
    if missing:
        raise SystemExit(f"installed no dist-info for: {', '.join(missing)}")
    return dists


def trim(dist: Dist, stage: Path) -> None:
    rule = TRIMS.get(dist.name)
    if rule is None:
        return
    kept = []
    for rel in dist.files:
        dropped = rel.startswith(rule.drop_prefixes) if rule.drop_prefixes else False
        if rule.keep_only_so is not None and rel.endswith(".so") and rel not in rule.keep_only_so:
            dropped = True
        (stage / rel).unlink() if dropped else kept.append(rel)
    for rel in rule.strip:
        if rel not in kept:
            raise SystemExit(f"{dist.name}: {rel} is not in the wheel (the trim rule is stale)")
        subprocess.run(["strip", "--strip-unneeded", str(stage / rel)], check=True)
    dist.files = kept


def record_hash(path: Path) -> str:
    """``RECORD``'s hash of a file: ``sha256=`` and the urlsafe base64 digest without padding."""
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def normalize(dist: Dist, stage: Path) -> None:
    """Drop what ``pip install`` recorded about this install (:data:`INSTALL_RECORDS`) and write the
    distribution's ``RECORD`` again from the files that travel (trimmed ones gone, no console script
    outside the tree, whose shebang and hash are this machine's interpreter), so the archive holds
    nothing of the machine, the wheel's directory or the staging directory."""
    info = next((rel.split("/")[0] for rel in dist.files if rel.split("/")[0].endswith(".dist-info")), None)
    if info is None:
        raise SystemExit(f"{dist.name}: no .dist-info among its files")
    for name in INSTALL_RECORDS:
        rel = f"{info}/{name}"
        if rel in dist.files:
            (stage / rel).unlink()
            dist.files.remove(rel)
    record = f"{info}/RECORD"
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    for rel in sorted(set(dist.files) | {record}):
        writer.writerow((rel, "", "") if rel == record else (rel, record_hash(stage / rel), (stage / rel).stat().st_size))
    (stage / record).write_text(rows.getvalue())
    dist.files = sorted(set(dist.files) | {record})


def pack(files: Iterable[str], stage: Path, archive: Path) -> None:
    """A reproducible tar.xz of ``files`` under ``stage``: sorted names, PAX, mtime 0, owner 0/0
    without names, mode 0755 where any execute bit is set and 0644 otherwise (the umask's mark)."""
    def norm(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        info.mode = 0o755 if info.mode & 0o111 else 0o644
        return info

    with tarfile.open(archive, "w:xz", preset=6, format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(files):
            tar.add(stage / rel, arcname=rel, filter=norm, recursive=False)


def stage_and_pack(wheels: dict[str, Path], pins: dict[str, str], archives: Path) -> list[Dist]:
    """Install ``wheels`` into a fresh staging tree, trim and normalise each pinned distribution, and
    pack it as ``archives/<name>.tar.xz``."""
    with tempfile.TemporaryDirectory(prefix="kvalign-gpu-stage-") as tmp:
        stage = Path(tmp)
        install(wheels, stage)
        dists = dist_files(stage, pins, wheels)
        for dist in dists:
            trim(dist, stage)
            normalize(dist, stage)
            pack(dist.files, stage, archives / f"{dist.name}.tar.xz")
    return dists


def place(sizes: dict[str, int], limit: int = CHUNK_LIMIT) -> list[list[str]]:
    """First-fit decreasing: archive names into chunks of at most ``limit`` bytes each."""
    chunks: list[list[str]] = []
    room: list[int] = []
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        if size > limit:
            raise SystemExit(f"{name} is {size / MIB:.1f} MiB, over one chunk's {limit / MIB:.0f} MiB")
        for i, free in enumerate(room):
            if size <= free:
                chunks[i].append(name)
                room[i] -= size
                break
        else:
            chunks.append([name])
            room.append(limit - size)
    return chunks


def fetch_debs(out: Path) -> list[dict[str, object]]:
    entries = []
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", *DEBS], cwd=tmp, check=True, capture_output=True)
        for deb in sorted(Path(tmp).glob("*.deb")):
            name, version = deb.name.split("_")[:2]
            shutil.copy(deb, out / deb.name)
            entries.append({"name": name, "version": version, "file": deb.name, "bytes": deb.stat().st_size,
                            "sha256": sha256(deb)})
    return entries


def build(out: Path, wheels_dir: Path) -> dict[str, object]:
    pins = read_requirements()
    wheels = download(pins, wheels_dir)
    if out.exists():
        shutil.rmtree(out)
    archives = out / "archives"
    archives.mkdir(parents=True)
    dists = stage_and_pack(wheels, pins, archives)
    debs = fetch_debs(archives)
    sizes = {p.name: p.stat().st_size for p in archives.iterdir()}
    chunks = place(sizes)
    chunk_of = {name: f"chunk-{i + 1}" for i, names in enumerate(chunks) for name in names}
    for name, chunk in chunk_of.items():
        (out / chunk).mkdir(exist_ok=True)
        (archives / name).rename(out / chunk / name)
    archives.rmdir()
    return {
        "python": PYTHON_VERSION, "platforms": list(PLATFORMS), "chunk_limit": CHUNK_LIMIT, "call_limit": CALL_LIMIT,
        "built_with": {"strip": tool_version(["strip", "--version"]),
                       "pip": tool_version([sys.executable, "-m", "pip", "--version"]).split(" from ")[0]},
        "machine_dependent": MACHINE_DEPENDENT,
        "distributions": [
            {"name": d.name, "version": d.version, "wheel": d.wheel.name, "wheel_sha256": sha256(d.wheel),
             "archive": f"{d.name}.tar.xz", "archive_bytes": sizes[f"{d.name}.tar.xz"],
             "archive_sha256": sha256(out / chunk_of[f"{d.name}.tar.xz"] / f"{d.name}.tar.xz"),
             "chunk": chunk_of[f"{d.name}.tar.xz"], **({"trim": TRIMS[d.name].why} if d.name in TRIMS else {})}
            for d in dists],
        "debs": [{**e, "chunk": chunk_of[str(e["file"])]} for e in debs],
        "chunks": [{"name": f"chunk-{i + 1}", "bytes": sum(sizes[n] for n in names), "files": sorted(names)}
                   for i, names in enumerate(chunks)],
    }


@dataclass(frozen=True)
class Verdict:
    """One distribution packed here against its manifest entry."""

    name: str
    same: bool
    why: str  # what differs, or "" when the archive is byte-equal
    machine_dependent: bool  # the manifest names its archive as one a tool's release shapes


def verify(wheels_dir: Path, manifest: dict[str, object], pins: dict[str, str] | None = None) -> list[Verdict]:
    """Pack each pinned wheel present in ``wheels_dir`` as :func:`build` does and compare its archive
    (SHA-256 and size) with ``manifest``'s entry. A wheel other than the manifest's (its SHA-256 differs)
    is refused: that is another input, not a reproducibility result."""
    pins = read_requirements() if pins is None else pins
    present = local_wheels(pins, wheels_dir)
    if not present:
        raise SystemExit(f"--verify: no pinned wheel in {wheels_dir}")
    entries = {str(d["name"]): d for d in manifest["distributions"]}  # type: ignore[union-attr]
    for name, whl in present.items():
        if name not in entries:
            raise SystemExit(f"--verify: {whl.name} is pinned but not in the manifest (build the bundle again)")
        if sha256(whl) != entries[name]["wheel_sha256"]:
            raise SystemExit(f"--verify: {whl.name} is not the wheel the manifest was built from (its SHA-256 differs)")
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="kvalign-gpu-verify-") as tmp:
        dists = stage_and_pack(present, {n: pins[n] for n in present}, Path(tmp))
        for dist in dists:
            archive, entry = Path(tmp) / f"{dist.name}.tar.xz", entries[dist.name]
            got = (sha256(archive), archive.stat().st_size)
            want = (entry["archive_sha256"], entry["archive_bytes"])
            why = "" if got == want else f"archive {got[0][:12]}.. {got[1]} B, manifest {str(want[0])[:12]}.. {want[1]} B"
            dependent = any(f"[{dist.name}]" in key for key in MACHINE_DEPENDENT)
            verdicts.append(Verdict(dist.name, got == want, why, dependent))
    return verdicts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / ".gpu-bundle", help="where the chunks go (git-ignored)")
    p.add_argument("--wheels", type=Path, default=Path.home() / ".cache" / "kvalign" / "gpu-wheels",
                   help="the downloaded wheels (kept between builds)")
    p.add_argument("--verify", action="store_true",
                   help="pack the pinned wheels present in --wheels and compare each archive with the committed "
                        "manifest; writes nothing; exit 1 if one that is not machine-dependent differs")
    args = p.parse_args(argv)
    if args.verify:
        verdicts = verify(args.wheels, json.loads(MANIFEST.read_text()))
        for v in verdicts:
            label = "same" if v.same else ("differs (machine-dependent)" if v.machine_dependent else "DIFFERS")
            print(f"{label:28} {v.name}{'  ' + v.why if v.why else ''}")
        bad = [v.name for v in verdicts if not v.same and not v.machine_dependent]
        same = sum(v.same for v in verdicts)
        print(f"{same} of {len(verdicts)} archives equal to the manifest's SHA-256"
              + (f"; differing, not named machine-dependent: {', '.join(bad)}" if bad else ""))
        return 1 if bad else 0
    manifest = build(args.out, args.wheels)
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    for chunk in manifest["chunks"]:
        print(f"{chunk['name']}: {chunk['bytes'] / MIB:.1f} MiB, {len(chunk['files'])} archives")
    print(f"manifest: {MANIFEST.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
