"""The real-engine GPU worker kind's commands and the GPU-shaped tiny models it serves.

The workers ran on the H100 (docs/gpu/: ``kvalign e2e run --engine sglang-gpu --single-gpu``, the
fuzz, HiCache); here: what they are started with, that nothing of the CPU stand-in reaches them,
and that the models keep what the assertions rely on (zero target head, agreeing or disagreeing
draft) in bf16.
"""

from __future__ import annotations

import pytest

from kvalign.live.cluster.topology import Topology
from kvalign.live.engines import engine_model
from kvalign.live.engines.hicache import HiCache
from kvalign.live.engines.sglang_gpu import mem_fraction, plan_cluster
from kvalign.live.engines.sglang_worker import gpu_topology
from kvalign.standins import sglang_cpu as sglang_cpu_standin
from kvalign.standins import sglang_gpu as sglang_gpu_standin


def _flags(argv: list[str]) -> dict[str, str | None]:
    """Each ``--flag`` with its value (None for a bare switch)."""
    return {a: (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None)
            for i, a in enumerate(argv) if a.startswith("--")}


def test_single_gpu_disaggregated_commands(tmp_path):
    plan, kind = plan_cluster(gpu_topology(single_gpu=True), tmp_path, hicache=HiCache("write_back"))
    specs = {w.name: kind.command(w, plan) for w in plan.topology.workers}
    for name, spec in specs.items():
        f = _flags(spec.argv)
        assert spec.argv[1:3] == ["-m", "dynamo.sglang"]
        assert (f["--device"], f["--attention-backend"], f["--dtype"]) == ("cuda", "triton", "bfloat16")
        assert "--disable-cuda-graph" in f and f["--mem-fraction-static"] == "0.26"  # 0.8 split by 3 workers
        assert f["--disaggregation-transfer-backend"] == "nixl" and f["--host"] == "127.0.0.1"
        assert "--disaggregation-enable-kv-checksum" in f  # SGLang's own CUDA checksum, as shipped
        assert spec.env["SGLANG_HOST_IP"] == "127.0.0.1" and "UCX_TLS" not in spec.env  # UCX picks cuda_ipc
        assert (f["--speculative-num-steps"], f["--speculative-eagle-topk"], f["--speculative-num-draft-tokens"]) == ("3", "1", "4")
        assert spec.env["CUDA_VISIBLE_DEVICES"] == "0"
        assert spec.env["PYTHONPATH"].split(":")[0] == str(sglang_gpu_standin.SITE_DIR)
        assert spec.env[sglang_gpu_standin.ENABLE_ENV] == "1" and spec.env["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] == "python"
        assert sglang_cpu_standin.ENABLE_ENV not in spec.env and "SGLANG_USE_CPU_ENGINE" not in spec.env
        assert str(sglang_cpu_standin.SITE_DIR) not in spec.env["PYTHONPATH"]
        assert ("--enable-hierarchical-cache" in f) == name.startswith("prefill")  # SGLang's own host tier
    assert "--disaggregation-decode-retraction-backup" not in specs["decode0"].argv  # the CPU's workaround only


def test_memory_split_follows_the_gpu_each_worker_is_on(tmp_path):
    plan, kind = plan_cluster(gpu_topology(single_gpu=False), tmp_path)
    by_name = {w.name: mem_fraction(w, plan) for w in plan.topology.workers}
    assert by_name == {"prefill0": 0.4, "prefill1": 0.4, "decode0": 0.8}
    assert kind.command(plan.topology.by_role("decode")[0], plan).env["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(ValueError, match="no draft model"):
        type(kind)(None).command(plan.topology.workers[0], plan)


def test_an_aggregated_fuzz_topology_runs_on_gpu_0(tmp_path):
    plan, kind = plan_cluster(Topology.aggregated(2, eagle=True, page_size=4), tmp_path)
    for w in plan.topology.workers:
        spec = kind.command(w, plan)
        assert spec.env["CUDA_VISIBLE_DEVICES"] == "0" and _flags(spec.argv)["--page-size"] == "4"


@pytest.mark.parametrize("draft", engine_model.DRAFTS)
def test_gpu_models_are_bf16_with_the_cpu_models_rules(tmp_path, draft):
    from safetensors.torch import load_file  # torch: when this test runs, not at collection

    target_dir, draft_dir = engine_model.write_models(tmp_path, draft, engine_model.GPU)
    target, drafted = load_file(str(target_dir / "model.safetensors")), load_file(str(draft_dir / "model.safetensors"))
    import torch

    assert {t.dtype for t in (*target.values(), *drafted.values())} == {torch.bfloat16}
    assert target["model.embed_tokens.weight"].shape == (engine_model.VOCAB, engine_model.GPU.hidden)
    assert not target["lm_head.weight"].any()  # greedy output is the leading word, whatever the KV
    assert bool(drafted["lm_head.weight"].any()) == (draft == "disagree")
    assert drafted["fc.weight"].shape == (engine_model.GPU.hidden, 3 * engine_model.GPU.hidden)
