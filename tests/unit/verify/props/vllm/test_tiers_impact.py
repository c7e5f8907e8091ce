"""vllm#57159's routing impact on the real router: a vLLM engine with a CPU tier of 4-block chunks and a plain
vLLM engine as the two data-parallel ranks of one worker behind Dynamo's relays and ``KvRouter``
(:mod:`kvalign.verify.props.vllm.tiers_impact`)."""

from __future__ import annotations

import pytest
from router_paths import open_router_path

from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.props.vllm.tiers_impact import CHUNK, measure_chunk_routing

B = 16


@pytest.mark.slow  # two vLLM engines (a second child imports vLLM: about 12 s of CPU) and up to 160 routings
def test_host_credit_for_a_partial_chunk_and_the_routers_choice():
    path = open_router_path("the two-rank relay -> KvRouter path for vLLM's events")
    try:
        impact = measure_chunk_routing(path, B)
    except OracleUnavailable as exc:
        pytest.skip(f"two vLLM ranks behind the real router: {exc}")
    finally:
        path.close()
    assert (impact.credited, impact.reusable) == (CHUNK - 1, 0)
    assert [t.reused[0] for t in impact.trials] == [0] * CHUNK  # the connector loads nothing of the partial chunk
    assert [t.reused[1] for t in impact.trials] == [B * k for k in range(CHUNK)]
    # 3 host blocks at the binding's default host_cache_hit_weight outscore 1 and 2 device blocks, not 3
    assert [t.k for t in impact.trials if t.changed] == [1, 2]
    assert "changes the worker for 2 of 4 k (1, 2)" in impact.says()
