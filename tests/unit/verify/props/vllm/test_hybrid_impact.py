"""The vLLM hybrid findings' routing impact on the real router: two hybrid vLLM engines (vLLM's real
``KVCacheManager`` and publisher each) as the two data-parallel ranks of one worker behind Dynamo's relays and
``KvRouter`` (:mod:`kvalign.verify.props.vllm.hybrid_impact`): the sliding-window hybrid and the Mamba one."""

from __future__ import annotations

import pytest
from router_paths import open_router_path

from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.props.vllm.hybrid_impact import KINDS, QUERY_BLOCKS, finding_steps, measure_hybrid_routing

B = 16


@pytest.mark.slow  # two vLLM engines (a second child imports vLLM: about 12 s of CPU) and 200 routings
@pytest.mark.parametrize(("kind", "base"), [("swa", 7 << 20), ("mamba", 13 << 20)])
def test_the_router_sends_the_query_to_the_engine_that_reuses_nothing(kind, base):
    """Window hybrid: the window blocks before the query's end evicted; Mamba hybrid: no state kept at the
    query's end (the prompt's prefill was one step to its fifth block)."""
    path = open_router_path("the two-rank relay -> KvRouter path for vLLM's events")
    try:
        impact = measure_hybrid_routing(path, B, base, kind=kind)
    except OracleUnavailable as exc:
        pytest.skip(f"two vLLM ranks behind the real router: {exc}")
    finally:
        path.close()
    assert (impact.credited, impact.reusable) == (QUERY_BLOCKS, 0)
    assert [t.k for t in impact.trials] == list(range(QUERY_BLOCKS + 1))
    # k = 1..3: the other rank holds k blocks vLLM reuses, the router picks the one crediting 4 and reusing none
    assert [t.k for t in impact.trials if t.changed] == [1, 2, 3]
    assert impact.changes_worker and "changes the worker for 3 of 5 k (1, 2, 3)" in impact.says()


def test_each_kinds_steps_leave_its_finding():
    """The window hybrid's steps serve the prompt twice and then a short prompt (evicting window blocks only); the
    Mamba hybrid's serve it once: its one prefill step keeps a state at its end only."""
    first = list(range(5 * B + 1))
    swa, mamba = finding_steps("swa", first, B, 0), finding_steps("mamba", first, B, 0)
    assert swa[:2] == [first, first] and len(swa[2]) == 2 * B + 1 and not set(swa[2]) & set(first)
    assert mamba == [first]
    assert KINDS["swa"][0](B) == {"sliding_window": 2 * B} and KINDS["mamba"][0](B) == {"mamba": True}
