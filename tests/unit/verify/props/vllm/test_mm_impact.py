"""The unmarked image identifier's routing impact on the real router: two vLLM engines as the two data-parallel
ranks of one worker behind Dynamo's relays and ``KvRouter``, the query routed by text prefix as the frontend routes
a request whose images it forwards no hashes for (:mod:`kvalign.verify.props.vllm.mm_impact`)."""

from __future__ import annotations

import pytest
from router_paths import open_router_path

from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.props.vllm.mm_impact import _within, measure_mm_routing

B = 16


def test_a_prefix_keeps_the_images_it_covers_cut_at_its_end():
    images = [("a", 16, 32)]
    assert [_within(images, n) for n in (16, 32, 48, 64)] == [[], [("a", 16, 16)], [("a", 16, 32)], [("a", 16, 32)]]


@pytest.mark.slow  # two vLLM engines (a second child imports vLLM: about 12 s of CPU) and up to 200 routings
def test_the_router_sends_the_other_image_to_the_engine_that_reuses_its_text_only():
    path = open_router_path("the two-rank relay -> KvRouter path for vLLM's events")
    try:
        impact = measure_mm_routing(path, B)
    except OracleUnavailable as exc:
        pytest.skip(f"two vLLM ranks behind the real router: {exc}")
    finally:
        path.close()
    # the router credits all 4 blocks of the first image's prompt; vLLM reuses the text block before the image
    assert (impact.credited, impact.reusable) == (4, 1)
    assert [t.reused for t in impact.trials] == [(B, B * k) for k in range(5)]
    # k = 2, 3: the other engine reuses more, the router picks the one crediting 4; k = 1 costs nothing, k = 4 ties
    assert [t.k for t in impact.trials if t.changed] == [2, 3]
    assert "changes the worker for 2 of 5 k (2, 3)" in impact.says()
