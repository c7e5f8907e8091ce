# Sourced on the GPU machine after scripts/gpu/unpack.sh: the bundle first on PYTHONPATH, kvalign from
# this checkout, and OpenSSL's headers for SGLang's JIT-built KV-event hash where the image has none.
SITE=${KVALIGN_GPU_SITE:-/tmp/site}
DEBS=${KVALIGN_GPU_DEBS:-/tmp/kvalign-debs}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
for c in $(python3 -c 'import json; print(" ".join(c["name"] for c in json.load(open("'"$REPO"'/scripts/gpu/manifest.json"))["chunks"]))'); do
  [ -e "$SITE/.kvalign-$c" ] || { echo "kvalign: $c of the GPU bundle is not unpacked in $SITE (scripts/gpu/unpack.sh $c)" >&2; return 2; }
done
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ ! -f /usr/include/openssl/sha.h ] && [ -f "$DEBS/usr/include/openssl/sha.h" ]; then
  export CPATH="$DEBS/usr/include:$DEBS/usr/include/x86_64-linux-gnu${CPATH:+:$CPATH}"
  lib=$(ldconfig -p | awk '/libcrypto\.so\.3 .*x86-64/ {print $NF; exit}')
  if [ -n "$lib" ]; then
    mkdir -p "$DEBS/lib" && ln -sf "$lib" "$DEBS/lib/libcrypto.so"
    export LIBRARY_PATH="$DEBS/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  fi
fi
# NIXL's UCX CUDA module (nixl-cu13) needs libcudart.so.13: torch's process has it loaded already, and
# this finds it for any other (torch's nvidia-cuda-runtime wheel), appended so nothing else is shadowed.
cudart=$(python3 -c 'import glob, os, nvidia; print(next(iter(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/**/libcudart.so.13", recursive=True)})), ""))' 2>/dev/null)
[ -n "$cudart" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$cudart"
unset cudart
