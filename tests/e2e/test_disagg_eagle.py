"""EAGLE3 with prefill/decode disaggregation through Dynamo's KV router: one scenario, three engines.

2 SGLang prefill workers + 1 decode worker, EAGLE3 on both sides, behind
``dynamo.frontend --router-mode kv``; the scenario and its four assertions are
:mod:`kvalign.live.runs.disagg_eagle` over the shared harness. Only the engine differs:

* ``sglang-gpu`` (gpu_2 / gpu_1 nightly): real ``dynamo.sglang`` on GPUs with Qwen3-8B + its EAGLE3
  draft (``KVALIGN_MODEL`` / ``KVALIGN_DRAFT_MODEL``); skips, naming every missing prerequisite,
  on machines without the GPUs, a CUDA SGLang, ``dynamo.sglang`` or the weights. Negative
  control: ``KVALIGN_ROUTER_EAGLE=off`` (or ``--kvalign-router-eagle off``) must fail assertion 2.
* ``sglang-cpu`` (CI): the same real ``dynamo.sglang`` on this CPU with the tiny offline Llama +
  EAGLE3 draft (the KV-dependent pair: the target's output depends on every page of the prompt's
  KV, the draft's acceptance on its own state). Prefill hands each request's KV to decode over
  SGLang's NIXL backend (UCX/TCP on 127.0.0.1) and SGLang's KV checksum verifies it; one
  aggregated worker answers the same prompts as the reference (assertion 5: disaggregation is
  invisible; assertion 6: the KV moved and was verified). CI runs the aligned scenario and the
  decode half's negative control (``fake``: decode without the KV, KV_NOT_TRANSFERRED); the
  routing and draft controls and the shipped release's cluster run in the nightly
  (``KVALIGN_NIGHTLY=1``): CI holds the same controls on the real engine through the fuzz
  (``test_fuzz.py::TestBlindCluster``, ``TestShippedPair``). What stays GPU-only: multi-step /
  tree EAGLE (CPU runs num-steps 1, topk 1, 2 draft tokens), CUDA graphs and the production
  attention kernels.
* ``fake-cpu`` (CI): kvalign's fake workers (SGLang's real radix cache, no model, no speculation),
  on the session's shared cluster of each configuration (the aligned one is also
  ``test_router_cpu``'s bootstrap-endpoint prefill/decode cluster).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvalign.model.causes import Cause
from kvalign.live.runs import disagg_eagle
from kvalign.live.cluster.lifecycle import Cluster
from kvalign.live.runs.disagg_eagle import E2eOptions, E2eResult
from kvalign.live.runs.disagg_invisible import DecodeRecord
from kvalign.live.wire.metrics import MIN_TOKENS_PER_VERIFY
from kvalign.live.engines.sglang_worker import ROUTER_EAGLE_ENV, TINY_MODEL, EagleConfig, default_models, router_eagle_from
from kvalign.live.cluster.topology import CpuWorkerKind

pytestmark = [pytest.mark.e2e]


@pytest.fixture
def router_eagle(request: pytest.FixtureRequest) -> bool:
    """The negative-control switch: the pytest option if registered and given, else the env var."""
    value = request.config.getoption("--kvalign-router-eagle", default=None)
    return router_eagle_from(value if value is not None else os.environ.get(ROUTER_EAGLE_ENV))


def _run_on_gpus(opts: E2eOptions, run_dir: Path) -> E2eResult:
    pre = disagg_eagle.prerequisites(opts)
    if pre is not None and pre.skip_reason:
        pytest.skip(pre.skip_reason)
    plan, kind = disagg_eagle.build(opts, run_dir)
    with Cluster(plan, kind, startup_timeout_s=opts.startup_timeout_s) as cluster:
        result = disagg_eagle.run(cluster, opts, print)
    print(result.report())
    if not result.passed:
        pytest.fail(result.report(), pytrace=False)
    if opts.model == TINY_MODEL:  # kvalign's tiny pair: the CPU scenario's exact assertions hold too
        _assert_exact(result, accept_length=float(EagleConfig().num_draft_tokens))
    return result


def _assert_exact(result: E2eResult, accept_length: float) -> None:
    """What a tiny-model run must show beyond the four assertions: every request on one prefill worker,
    decode on a decode worker, the router's kv_hit_rate equal to kvalign's prediction from the captured
    events on every request, and every draft token accepted (the zero-head draft agrees)."""
    records, window = result.records, result.window
    assert {r.worker for r in records} <= result.worker_ids["prefill"] and len({r.worker for r in records}) == 1
    assert {r.result.decode_worker_id for r in records} <= result.worker_ids["decode"]
    assert records[0].observed == 0.0 and all(r.observed > 0 for r in records[1:]), result.report()
    assert [r.observed for r in records] == pytest.approx([r.predicted for r in records], abs=1e-9), result.report()
    assert window.verify_calls > 0 and window.tokens_per_verify > MIN_TOKENS_PER_VERIFY, result.report()
    assert window.accept_length == pytest.approx(accept_length), result.report()


# ---- sglang-gpu: the nightly ------------------------------------------------------------------

@pytest.mark.gpu_2
@pytest.mark.nightly
@pytest.mark.timeout(1800)
def test_router_decisions_sglang_disagg_eagle(live_run_dir, router_eagle):
    model, draft = default_models()
    _run_on_gpus(E2eOptions(model=model, draft_model=draft, router_eagle=router_eagle, pair="zero-head"), live_run_dir)


@pytest.mark.gpu_1
@pytest.mark.nightly
@pytest.mark.timeout(1800)
def test_router_decisions_sglang_disagg_eagle_single_gpu(live_run_dir, router_eagle):
    """One GPU: 2 prefill + 1 decode workers on GPU 0 (kvalign's tiny pair: SGLang's ``fake`` transfer)."""
    model, draft = default_models()
    _run_on_gpus(E2eOptions(model=model, draft_model=draft, single_gpu=True, router_eagle=router_eagle, pair="zero-head"),
                 live_run_dir)


# ---- sglang-cpu: the real engine on this CPU (CI) ---------------------------------------------

def _run_sglang_cpu(opts: E2eOptions, run_dir: Path, reference: list[DecodeRecord] | None = None) -> E2eResult:
    plan, kind = disagg_eagle.build(opts, run_dir)
    with Cluster(plan, kind, startup_timeout_s=opts.startup_timeout_s) as cluster:
        result = disagg_eagle.run(cluster, opts, print)
    if opts.decode_half:
        disagg_eagle.judge_decode_half(result, reference)
    print(result.report())
    return result


@pytest.fixture(scope="module")
def sglang_cpu_reference(sglang_cpu_engine: None, sglang_release: str | None, module_run_dir: Path) -> list[DecodeRecord]:
    """The scenario's prompts on one aggregated worker (the KV-dependent pair): what every
    disaggregated run below must answer, token for token (shared: the prompts and models are the same)."""
    return disagg_eagle.reference(E2eOptions(engine="sglang-cpu", startup_timeout_s=400, sglang=sglang_release),
                                  module_run_dir / "aggregated", print)


@pytest.fixture(scope="module")
def sglang_cpu_aligned(sglang_cpu_reference: list[DecodeRecord], sglang_release: str | None,
                       module_run_dir: Path) -> E2eResult:
    """The seed scenario on real SGLang CPU workers, router and engine aligned, the KV moved by NIXL."""
    return _run_sglang_cpu(E2eOptions(engine="sglang-cpu", startup_timeout_s=400, sglang=sglang_release),
                           module_run_dir / "aligned", sglang_cpu_reference)


@pytest.fixture(scope="module")
def sglang_cpu_fake_transfer(sglang_cpu_reference: list[DecodeRecord], sglang_release: str | None,
                             module_run_dir: Path) -> E2eResult:
    """The decode half's negative control: SGLang's ``fake`` backend, decode without the prompt's KV.
    One prefill worker: what fails here is the hand-off to decode, which one prefill worker makes as
    two do (the routing choice between two is the aligned run's); a scheduler fewer to start."""
    opts = E2eOptions(engine="sglang-cpu", transfer="fake", prefill=1, startup_timeout_s=400, sglang=sglang_release)
    return _run_sglang_cpu(opts, module_run_dir / "fake-transfer", sglang_cpu_reference)


@pytest.fixture(scope="module")
def sglang_cpu_controls(sglang_cpu_engine: None, sglang_release: str | None, module_run_dir: Path) -> E2eResult:
    """Both live negative controls in one cluster (each breaks a different, independent
    assertion): workers register ``enable_eagle`` off, and the draft never agrees with the
    target. 5-token outputs make the naive gen/verify ratio 5/4 = 1.25 at zero acceptance."""
    opts = E2eOptions(engine="sglang-cpu", router_eagle=False, draft="disagree", max_tokens=5, startup_timeout_s=400,
                      sglang=sglang_release, compare_aggregated=False)
    return _run_sglang_cpu(opts, module_run_dir / "controls")


@pytest.mark.nightly
@pytest.mark.skipif(os.environ.get("KVALIGN_NIGHTLY") != "1", reason="a second SGLang release's cluster: nightly only "
                    "(KVALIGN_NIGHTLY=1); CI runs the shipped release live in tests/e2e/test_fuzz.py::TestShippedPair")
@pytest.mark.timeout(600)
def test_real_engine_cpu_on_the_shipped_sglang_release(shipped_release, module_run_dir):
    """The seed scenario with the workers on the SGLang that Dynamo 1.6.1 deploys (0.5.21: no
    ``bind`` in its KV-events config, so its events reach the relay through the loopback
    forwarder; a paged allocator without a CPU path, so the stand-in's per-release patch)."""
    result = _run_sglang_cpu(E2eOptions(engine="sglang-cpu", startup_timeout_s=400, sglang=shipped_release,
                                        pair="zero-head", compare_aggregated=False),
                             module_run_dir / f"shipped-{shipped_release}")
    assert result.passed, result.report()
    records = result.records
    assert [r.observed for r in records] == pytest.approx([r.predicted for r in records], abs=1e-9), result.report()
    assert all(r.observed > 0 for r in records[1:]) and result.window.accept_length == pytest.approx(2.0)


def _failure(result: E2eResult, n: int) -> list[str]:
    return [f for f in result.failures if f.startswith(f"assertion {n} ")]


@pytest.mark.timeout(420)
def test_real_engine_cpu_routes_by_prefix_and_keeps_speculating(sglang_cpu_aligned):
    result = sglang_cpu_aligned
    assert result.passed, result.report()
    records, window = result.records, result.window
    # (1) one prefill worker for all four, never a decode worker; decode on the decode worker
    assert {r.worker for r in records} <= result.worker_ids["prefill"] and len({r.worker for r in records}) == 1
    assert {r.result.decode_worker_id for r in records} <= result.worker_ids["decode"]
    # (2) the router's kv_hit_rate is kvalign's prediction from the captured events, exactly
    assert records[0].observed == 0.0 and all(r.observed > 0 for r in records[1:]), result.report()
    assert [r.observed for r in records] == pytest.approx([r.predicted for r in records], abs=1e-9), result.report()
    # (3) decode ran verify steps; (4) the draft's tokens were accepted (measured: the KV pair's draft
    # mirrors the target's attention, so it agrees only with its own state intact)
    assert window.verify_calls > 0 and window.tokens_per_verify > MIN_TOKENS_PER_VERIFY
    # (5) disaggregation is invisible: each answer and its verify steps equal the aggregated worker's
    assert [r.token_ids for r in result.decoded] == [r.token_ids for r in result.reference], result.report()
    assert [r.verify_calls for r in result.decoded] == [r.verify_calls for r in result.reference], result.report()
    assert len({r.token_ids for r in result.decoded}) == len(records), "the KV pair answers each prompt its own way"
    # (6) every request's KV moved over NIXL and SGLang's checksum verified it on decode
    for t in result.transfers:
        assert t.backend == "nixl" and t.transfers == 1 and t.bytes_moved > 0 and t.latency_ms > 0, result.report()
        assert t.checksums == (True,) and t.checksum_tokens == records[t.request - 1].result.prompt_tokens


@pytest.mark.timeout(420)
def test_real_engine_cpu_fake_transfer_fails_naming_decode_without_kv(sglang_cpu_fake_transfer):
    """The negative control of the decode half: nothing moves, so decode answers from pages it never
    received. Routing (assertions 1-2) and the verify steps (3) still pass; acceptance (4) depends on
    what the decode worker's unsent pages happen to hold (seen both 2.0 and 1.0 here), so it is not
    what fails this control: the decode half does, naming the cause on every request."""
    result = sglang_cpu_fake_transfer
    assert not any(_failure(result, n) for n in (1, 2, 3)), result.report()
    [fifth], [sixth] = _failure(result, 5), _failure(result, 6)
    cause = f"cause: {Cause.KV_NOT_TRANSFERRED.name}"
    assert "request 1: output token ids differ from the aggregated worker's at position 0" in fifth, result.report()
    assert fifth.count(cause) == len(result.records) and sixth.count(cause) == len(result.records), result.report()
    assert all(t.transfers == 0 and not t.exported and not t.checksums for t in result.transfers)


@pytest.mark.nightly
@pytest.mark.skipif(os.environ.get("KVALIGN_NIGHTLY") != "1", reason="a second real-engine cluster: nightly only "
                    "(KVALIGN_NIGHTLY=1); CI runs both controls on the real engine in tests/e2e/test_fuzz.py::"
                    "TestBlindCluster and through e2e run's assertions on the fake workers below")
@pytest.mark.timeout(420)
def test_real_engine_negative_control_router_eagle_off_fails_assertion_2_naming_the_cause(sglang_cpu_controls):
    result = sglang_cpu_controls
    second = _failure(result, 2)
    assert len(second) == 1, result.report()
    assert "kv_hit_rate not > 0 on requests [2, 3, 4]" in second[0], result.report()
    assert f"cause: {Cause.ROUTER_EAGLE_OFF.name} - {Cause.ROUTER_EAGLE_OFF.value}" in second[0], result.report()
    assert all(r.router_eagle is False for r in result.records)


@pytest.mark.nightly
@pytest.mark.skipif(os.environ.get("KVALIGN_NIGHTLY") != "1", reason="a second real-engine cluster: nightly only "
                    "(KVALIGN_NIGHTLY=1); CI runs both controls on the real engine in tests/e2e/test_fuzz.py::"
                    "TestBlindCluster and through e2e run's assertions on the fake workers below")
@pytest.mark.timeout(420)
def test_real_engine_negative_control_disagreeing_draft_fails_assertion_4_only(sglang_cpu_controls):
    result, window = sglang_cpu_controls, sglang_cpu_controls.window
    assert not _failure(result, 3) and window.verify_calls > 0, result.report()  # still speculating...
    fourth = _failure(result, 4)
    assert len(fourth) == 1 and "draft tokens are not being accepted" in fourth[0], result.report()
    assert window.accept_length <= MIN_TOKENS_PER_VERIFY and window.accept_rate == 0.0, result.report()
    # ...and the naive ratio would have passed it: each request's prefill hand-off token counts
    assert window.naive_tokens_per_verify > MIN_TOKENS_PER_VERIFY, result.report()


# ---- fake-cpu: kvalign's fake workers (CI) ------------------------------------------------------

@pytest.mark.timeout(150)
def test_same_scenario_through_cpu_workers_passes(shared_cluster):
    opts = E2eOptions(engine="fake-cpu")
    cluster = shared_cluster(opts.topology(), CpuWorkerKind())
    result = disagg_eagle.run(cluster, opts, print)
    print(result.report())
    assert result.passed, result.report()
    assert result.notes == ["assertions 3 and 4 not applicable: fake CPU workers run no speculative decoding "
                            "(no sglang:spec_* metrics)"]
    assert [r.observed for r in result.records][0] == 0.0
    assert all(r.observed > 0 for r in result.records[1:])


@pytest.mark.timeout(150)
def test_negative_control_fails_assertion_2_naming_the_cause(shared_cluster):
    opts = E2eOptions(engine="fake-cpu", router_eagle=False)
    cluster = shared_cluster(opts.topology(), CpuWorkerKind())
    assert not any(h.enable_eagle for h in cluster.workers.values())
    result = disagg_eagle.run(cluster, opts, print)
    print(result.report())
    second = [f for f in result.failures if f.startswith("assertion 2 ")]
    assert len(second) == 1, result.report()
    assert "kv_hit_rate not > 0 on requests [2, 3, 4]" in second[0]
    assert "cause: ROUTER_EAGLE_OFF - router eagle off vs engine bigram keys" in second[0]
    assert not [f for f in result.failures if f.startswith(("assertion 3", "assertion 4", "response"))], result.report()
