"""pages / overlap on vLLM: before each prompt of a sequence, vLLM's prefix hit = kvalign's prediction
from the real router's overlap, with evictions.

vLLM's real ``KVCacheManager`` (a small cache, so least-recently-used free blocks are evicted and
``BlockRemoved`` published) serves generated prompt sequences that share block-aligned prefixes; its
real publisher feeds Dynamo's real relay and ``KvRouter``. kvalign predicts vLLM's hit from the
router's overlap ``R`` (blocks) for a prompt of ``n`` tokens as ``B * min(R, (n - 1) // B)``: the
blocks both hold, except that vLLM always computes a prompt's last token (its hit stops one token
short of the prompt). Negative control: a hop that drops vLLM's ``BlockRemoved`` (a relay that misses
evictions): the router credits evicted blocks and the comparison names the query.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_paths import open_router_path
from vllm_paths import open_vllm_worker, rewrite_events, vllm_on_router

from kvalign.verify.props.vllm.controls import drop_removed

B = 16
#: usable blocks (vLLM keeps one null block): small, so the sequences below evict
NUM_BLOCKS = 10
_ranges = itertools.count(1)


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    with vllm_on_router(B, NUM_BLOCKS) as w:
        yield w


def prompts_from(shape: list[tuple[list[int], int]]) -> list[list[int]]:
    """Each prompt: its blocks drawn from a pool of 3 block contents (shared prefixes), then a tail,
    in a token range of its own (earlier examples' blocks stay cached but unreachable)."""
    base = next(_ranges) * 1000
    return [[base + c * B + i for c in chunks for i in range(B)] + [base + 999] * tail for chunks, tail in shape]


def served(worker: Any, prompts: list[list[int]]) -> list[tuple[int, int, int]]:
    """``(prompt index, vLLM's hit, predicted hit)`` per prompt, asked before it is served; each prompt is
    then served and its events indexed before the next."""
    out = []
    for i, tokens in enumerate(prompts):
        overlap = worker.overlap(tokens)
        hit = worker.engine.match(tokens)
        out.append((i, hit, B * min(overlap, (len(tokens) - 1) // B)))
        assert worker.engine.prefill(tokens) == hit
        worker.sync()
    return out


def mismatches(worker: Any, prompts: list[list[int]]) -> list[tuple[int, int, int]]:
    """The rows of :func:`served` where vLLM's hit and the prediction differ."""
    return [row for row in served(worker, prompts) if row[1] != row[2]]


shapes = st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=5), st.integers(0, B - 1)),
                  min_size=1, max_size=8)


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes)
def test_vllm_prefix_hit_equals_prediction_from_router_overlap(worker, shape):
    assert mismatches(worker, prompts_from(shape)) == []


#: the first prompt is evicted by the next three (9 usable blocks), then asked for again
EVICTING = [([0, 1, 2], 3), ([0, 0, 0, 0, 0], 1), ([1, 1, 1, 1, 1], 1), ([2, 2, 2, 2], 1), ([0, 1, 2], 3)]


def test_an_evicted_prompt_is_credited_by_neither(worker):
    rows = served(worker, prompts_from(EVICTING))
    assert [hit for _i, hit, _p in rows] == [0, B, 0, 0, 0]  # the last: all 3 of its blocks were evicted
    assert [predicted for _i, _h, predicted in rows] == [0, B, 0, 0, 0]


def test_negative_control_a_relay_missing_evictions_is_caught(worker):
    worker.hop.hop.transform = rewrite_events(drop_removed)
    try:
        found = mismatches(worker, prompts_from(EVICTING))
    finally:
        worker.hop.hop.transform = None
    assert found and found[-1][0] == len(EVICTING) - 1 and found[-1][2] > found[-1][1]


def test_a_prompt_larger_than_the_cache_is_refused_in_one_line(worker):
    from kvalign.oracles.vllm import VllmError

    with pytest.raises(VllmError, match=r"^MemoryError: vLLM cannot allocate 161 tokens in this cache$"):
        worker.engine.prefill(list(range(10 * B + 1)))
    assert worker.engine.match(list(range(B + 1))) == 0  # the engine still answers
