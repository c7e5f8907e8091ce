#!/usr/bin/env bash
# On the GPU machine: run kvalign's live layer stage by stage, each bounded in time, keeping every
# stage's JSON, exit code and log tail under $OUT (what comes back from the machine).
# usage: scripts/gpu/run.sh STAGE[:SECONDS] ...   (after scripts/gpu/unpack.sh; see docs/gpu/README.md)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/env.sh || exit 2
OUT=${OUT:-out/gpu}
R=/tmp/kvalign-gpu/results
mkdir -p "$OUT" "$R"
K=(python3 -m kvalign)
stage_cmd() {
  case "$1" in
    facts) echo 'python3 -c "import json; from kvalign.live.engines.gpu import environment; print(json.dumps(environment(), indent=1))"; which g++ ninja nvcc; ls /usr/include/openssl/sha.h; echo CPATH=${CPATH:-}' ;;
    imports) echo 'KVALIGN_SGLANG_GPU_STANDIN=1 SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 PYTHONPATH=kvalign/standins/sglang_gpu/site:$PYTHONPATH python3 -c "import sgl_kernel, dynamo._core, dynamo.llm, dynamo.sglang.main, sglang.kernels.ops.gemm.cutedsl_dual_gemm as m; print(sgl_kernel.__version__, m.__file__)"' ;;
    scenario) echo "${K[*]} e2e run --engine sglang-gpu --single-gpu --json --keep-logs --run-dir /tmp/kvalign-gpu/scenario" ;;
    control) echo "${K[*]} e2e run --engine sglang-gpu --single-gpu --router-eagle off --draft disagree --max-tokens 5 --json --keep-logs --run-dir /tmp/kvalign-gpu/control" ;;
    pytest) echo "python3 -m pytest -m 'gpu_1 or gpu_2' tests/e2e/test_disagg_eagle.py -n 0 -p no:randomly -rs -v" ;;
    fuzz) echo "${K[*]} e2e fuzz --engine sglang-gpu --examples 12 --steps 12 --shrink-seconds 60 --json --run-dir /tmp/kvalign-gpu/fuzz" ;;
    fuzz-disagg) echo "${K[*]} e2e fuzz --engine sglang-gpu --topology disagg --examples 8 --steps 12 --shrink-seconds 60 --json --run-dir /tmp/kvalign-gpu/fuzz-disagg" ;;
    fuzz-disagg4) echo "${K[*]} e2e fuzz --engine sglang-gpu --topology disagg --examples 4 --steps 12 --shrink-seconds 60 --json --run-dir /tmp/kvalign-gpu/fuzz-disagg4" ;;
    hicache4) echo "${K[*]} e2e fuzz --engine sglang-gpu --hicache --page-size 4 --shrink-seconds 60 --json --run-dir /tmp/kvalign-gpu/hicache4" ;;
    hicache16) echo "${K[*]} e2e fuzz --engine sglang-gpu --hicache --page-size 16 --json --run-dir /tmp/kvalign-gpu/hicache16" ;;
    # the decode half with a real transfer: SGLang's NIXL backend (nixl-cu13 from the bundle, UCX over
    # cuda_ipc/cuda_copy between the two processes on GPU 0), the KV checksum on both engines
    nixl-import) echo 'python3 -c "import torch, nixl; from nixl._api import nixl_agent, nixl_agent_config; a = nixl_agent(\"probe\", nixl_agent_config(backends=[\"UCX\"])); t = torch.ones(1 << 20, device=\"cuda\"); print(nixl._pkg.__name__, nixl._pkg.__file__, a.plugin_list, a.register_memory(t) is not None)"' ;;
    nixl-scenario) echo "${K[*]} e2e run --engine sglang-gpu --single-gpu --transfer nixl --json --keep-logs --run-dir /tmp/kvalign-gpu/nixl-scenario" ;;
    nixl-fake) echo "${K[*]} e2e run --engine sglang-gpu --single-gpu --transfer fake --json --keep-logs --run-dir /tmp/kvalign-gpu/nixl-fake" ;;
    nixl-injector) echo "${K[*]} e2e run --engine sglang-gpu --single-gpu --transfer nixl --checksum-mismatch-prob 1 --no-compare-aggregated --json --keep-logs --run-dir /tmp/kvalign-gpu/nixl-injector" ;;
    nixl-graphs) echo "${K[*]} e2e run --engine sglang-gpu --single-gpu --transfer nixl --cuda-graph --json --keep-logs --run-dir /tmp/kvalign-gpu/nixl-graphs" ;;
    # e2e fuzz takes no --transfer: the disaggregated fuzz runs on the engine's default (fake on sglang-gpu)
    fuzz-disagg-nixl) echo "${K[*]} e2e fuzz --engine sglang-gpu --topology disagg --transfer nixl --examples 4 --steps 12 --shrink-seconds 60 --json --run-dir /tmp/kvalign-gpu/fuzz-disagg-nixl" ;;
    *) return 1 ;;
  esac
}
for arg in "$@"; do
  name=${arg%%:*}; limit=${arg#*:}; [ "$limit" = "$arg" ] && limit=300
  cmd=$(stage_cmd "$name") || { echo "unknown stage $name" >&2; exit 2; }
  echo "== $name (<= ${limit}s): $cmd" | tee -a "$OUT/stages.txt"
  start=$(date +%s)
  timeout -k 10 "$limit" bash -c "$cmd" >"$R/$name.out" 2>"$R/$name.err"
  rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - start ))s" | tee -a "$OUT/stages.txt"
  tail -c 1500 "$R/$name.err"; tail -c 2500 "$R/$name.out"
  # each stage's output and the run dirs' logs, in one file (at most 8 files come back from the machine)
  tar -czf "$OUT/results.tar.gz" --exclude='*.safetensors' --exclude='*.ipc' -C /tmp kvalign-gpu 2>/dev/null
done
