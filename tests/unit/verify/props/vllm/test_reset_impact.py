"""vLLM's reset published late (``VLLM_RESET_PUBLISHED_LATE``) behind Dynamo's real relay and ``KvRouter``: the
finding on one worker with its negative control, and its routing impact on two vLLM engines as the two
data-parallel ranks of one worker (:mod:`kvalign.verify.props.vllm.reset_impact`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from router_paths import open_router_path
from vllm_paths import vllm_on_router

from kvalign.model.causes import CREDIT_SKEW, Cause, cause_class
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.props.vllm.reset_impact import NUM_BLOCKS, PROMPT_BLOCKS, STREAM, measure_reset_routing
from kvalign.verify.props.vllm.strategies import fresh_base

B = 16


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    with vllm_on_router(B, NUM_BLOCKS) as w:
        yield w


def _served_then_reset(worker: Any) -> list[int]:
    """A prompt of PROMPT_BLOCKS blocks and a token served (its stores indexed), then the cache reset while idle."""
    base = fresh_base()
    prompt = [base + i for i in range(PROMPT_BLOCKS * B)] + [base + 999]
    worker.engine.prefill(prompt)
    worker.sync()
    assert worker.overlap(prompt) == PROMPT_BLOCKS
    assert worker.engine.reset() is True
    return prompt


def test_finding_an_idle_workers_reset_reaches_the_router_with_its_next_step(worker):
    """vLLM drops every hash at once (it reuses 0 of the prompt) and queues ``AllBlocksCleared``; with no step
    since, the router still credits every block. The next request's step publishes the reset first, then that
    request's own store, and the credit is gone."""
    prompt = _served_then_reset(worker)
    worker.barrier()  # everything vLLM published so far is indexed
    assert (worker.overlap(prompt), worker.engine.match(prompt)) == (PROMPT_BLOCKS, 0)
    other = [fresh_base() + i for i in range(B)] + [1]
    worker.engine.prefill(other)
    assert [e["type"] for e in worker.sync()] == ["AllBlocksCleared", "BlockStored"]
    assert (worker.overlap(prompt), worker.engine.match(prompt), worker.overlap(other)) == (0, 0, 1)
    assert cause_class(Cause.VLLM_RESET_PUBLISHED_LATE) == CREDIT_SKEW


def test_negative_control_a_reset_published_at_once_leaves_no_stale_credit(worker):
    """The same reset with its queued event taken and published at once (as if a step followed it): the router
    credits nothing of the prompt, as vLLM reuses nothing."""
    prompt = _served_then_reset(worker)
    assert [e["type"] for e in worker.sync()] == ["AllBlocksCleared"]
    assert (worker.overlap(prompt), worker.engine.match(prompt)) == (0, 0)


@pytest.mark.slow  # two vLLM engines and 400 routings on one real router
def test_the_router_sends_requests_to_the_reset_engine_until_its_next_step():
    path = open_router_path("the two-rank relay -> KvRouter path for vLLM's events")
    try:
        impact = measure_reset_routing(path, B)
    except OracleUnavailable as exc:
        pytest.skip(f"two vLLM ranks behind the real router: {exc}")
    finally:
        path.close()
    assert (impact.late.credited, impact.late.reusable) == (PROMPT_BLOCKS, 0)
    # k = 1..3: the other rank holds k blocks vLLM reuses, the router picks the reset engine crediting 4
    assert [t.k for t in impact.late.trials if t.changed] == [1, 2, 3]
    assert "changes the worker for 3 of 5 k (1, 2, 3)" in impact.says()
    # the control: the reset published at once credits nothing, and never moves a request
    assert (impact.at_once.credited, impact.at_once.changes_worker) == (0, False)
    # the bound: one request at a time, only the first meets the stale credit (its step publishes the reset)
    assert [s.stale for s in impact.streams["late"]] == [True] + [False] * (STREAM - 1)
    assert impact.streams["late"][0].rank == 0 and impact.stale("at_once") == 0
