"""The vLLM hybrid finding's routing impact on the real router: two hybrid vLLM engines (vLLM's real
``KVCacheManager`` and publisher each) as the two data-parallel ranks of one worker behind Dynamo's relays and
``KvRouter`` (:mod:`kvalign.verify.props.vllm.hybrid_impact`)."""

from __future__ import annotations

import pytest
from router_paths import open_router_path

from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.props.vllm.hybrid_impact import QUERY_BLOCKS, measure_hybrid_routing

B = 16


@pytest.mark.slow  # two vLLM engines (a second child imports vLLM: about 12 s of CPU) and 200 routings
def test_the_router_sends_the_query_to_the_engine_that_reuses_nothing():
    path = open_router_path("the two-rank relay -> KvRouter path for vLLM's events")
    try:
        impact = measure_hybrid_routing(path, B)
    except OracleUnavailable as exc:
        pytest.skip(f"two vLLM ranks behind the real router: {exc}")
    finally:
        path.close()
    assert (impact.credited, impact.reusable) == (QUERY_BLOCKS, 0)
    assert [t.k for t in impact.trials] == list(range(QUERY_BLOCKS + 1))
    # k = 1..3: the other rank holds k blocks vLLM reuses, the router picks the one crediting 4 and reusing none
    assert [t.k for t in impact.trials if t.changed] == [1, 2, 3]
    assert impact.changes_worker and "changes the worker for 3 of 5 k (1, 2, 3)" in impact.says()
