"""EAGLE3 with prefill/decode disaggregation through Dynamo's KV router (the gpu_2 nightly).

2 SGLang prefill workers on GPU 0, 1 decode worker on GPU 1 (or all on GPU 0 for gpu_1), EAGLE3
on both sides, behind ``dynamo.frontend --router-mode kv``; the scenario and its assertions are
:mod:`kvalign.live.disagg_eagle` over the shared harness. The GPU tests skip, naming every
missing prerequisite, on machines without the GPUs, a CUDA SGLang, ``dynamo.sglang`` or the
weights (``KVALIGN_MODEL`` / ``KVALIGN_DRAFT_MODEL``; default Qwen/Qwen3-8B + its EAGLE3 draft).

Negative control: ``KVALIGN_ROUTER_EAGLE=off`` (or ``--kvalign-router-eagle off``) makes the
workers register ``enable_eagle=False``, so the router hashes plain blocks against bigram-keyed
caches; the GPU tests must then fail on assertion 2 with the cause named.

The CPU tests run the very same scenario code through the CPU workers, in CI.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvalign.live import disagg_eagle
from kvalign.live.cluster import Cluster
from kvalign.live.disagg_eagle import E2eOptions
from kvalign.live.sglang_worker import ROUTER_EAGLE_ENV, default_models, router_eagle_from
from kvalign.live.topology import CpuWorkerKind

pytestmark = [pytest.mark.e2e]


@pytest.fixture
def router_eagle(request: pytest.FixtureRequest) -> bool:
    """The negative-control switch: the pytest option if registered and given, else the env var."""
    value = request.config.getoption("--kvalign-router-eagle", default=None)
    return router_eagle_from(value if value is not None else os.environ.get(ROUTER_EAGLE_ENV))


def _run_on_gpus(opts: E2eOptions, run_dir: Path) -> None:
    pre = disagg_eagle.prerequisites(opts)
    if pre is not None and pre.skip_reason:
        pytest.skip(pre.skip_reason)
    plan, kind = disagg_eagle.build(opts, run_dir)
    with Cluster(plan, kind, startup_timeout_s=opts.startup_timeout_s) as cluster:
        result = disagg_eagle.run(cluster, opts, print)
    print(result.report())
    if not result.passed:
        pytest.fail(result.report(), pytrace=False)


@pytest.mark.gpu_2
@pytest.mark.nightly
@pytest.mark.timeout(1800)
def test_router_decisions_sglang_disagg_eagle(live_run_dir, router_eagle):
    model, draft = default_models()
    _run_on_gpus(E2eOptions(model=model, draft_model=draft, router_eagle=router_eagle), live_run_dir)


@pytest.mark.gpu_1
@pytest.mark.nightly
@pytest.mark.timeout(1800)
def test_router_decisions_sglang_disagg_eagle_single_gpu(live_run_dir, router_eagle):
    model, draft = default_models()
    _run_on_gpus(E2eOptions(model=model, draft_model=draft, single_gpu=True, router_eagle=router_eagle), live_run_dir)


@pytest.mark.timeout(150)
def test_same_scenario_through_cpu_workers_passes(live_cluster):
    opts = E2eOptions(cpu=True)
    cluster = live_cluster(opts.topology(), CpuWorkerKind())
    result = disagg_eagle.run(cluster, opts, print)
    print(result.report())
    assert result.passed, result.report()
    assert result.notes == ["assertion 3 not applicable: CPU workers run no speculative decoding (no sglang:spec_* metrics)"]
    assert [r.observed for r in result.records][0] == 0.0
    assert all(r.observed > 0 for r in result.records[1:])


@pytest.mark.timeout(150)
def test_negative_control_fails_assertion_2_naming_the_cause(live_cluster):
    opts = E2eOptions(cpu=True, router_eagle=False)
    cluster = live_cluster(opts.topology(), CpuWorkerKind())
    assert not any(h.enable_eagle for h in cluster.workers.values())
    result = disagg_eagle.run(cluster, opts, print)
    print(result.report())
    second = [f for f in result.failures if f.startswith("assertion 2 ")]
    assert len(second) == 1, result.report()
    assert "kv_hit_rate not > 0 on requests [2, 3, 4]" in second[0]
    assert "cause: ROUTER_EAGLE_OFF - router eagle off vs engine bigram keys" in second[0]
    assert not [f for f in result.failures if f.startswith(("assertion 3", "assertion 4"))], result.report()
