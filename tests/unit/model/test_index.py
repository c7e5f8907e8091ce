"""kvalign.model.index: the router's kv_hit_rate arithmetic and basic index semantics.

Overlap itself is held against Dynamo's real RadixTree by test_alignment and test_stateful."""

from __future__ import annotations

from kvalign.model.index import PrefixIndex, router_kv_hit_rate
from kvalign.model.relay import RouterCleared, RouterRemoved, RouterStored


def test_kv_hit_rate_counts_partial_last_block_like_the_router():
    # Observed on the live 1.6.1 frontend (tests/e2e): prompts of 21/39/57/75 tokens at B=16.
    assert [router_kv_hit_rate(o, n, 16) for o, n in [(0, 21), (1, 39), (2, 57), (3, 75)]] == [0.0, 1 / 3, 0.5, 0.6]
    assert router_kv_hit_rate(0, 0, 16) is None


def test_overlap_is_consecutive_blocks_per_worker_and_removal_cuts_below():
    idx = PrefixIndex()
    idx.apply(1, RouterStored(None, [(10, 100), (11, 101), (12, 102)]))
    idx.apply(2, RouterStored(None, [(20, 100)]))
    assert idx.overlap([100, 101, 102]) == {1: 3, 2: 1}
    assert idx.overlap([101]) == {}  # a query must start at the root
    idx.apply(1, RouterRemoved([11]))
    assert idx.overlap([100, 101, 102]) == {1: 1, 2: 1}
    assert idx.kv_hit_rate([100, 101, 102], 1, prompt_tokens=48, block_size=16) == 1 / 3
    idx.apply(2, RouterCleared())
    assert idx.overlap([100]) == {1: 1} and idx.workers() == [1]


def test_unknown_parent_drops_the_event():
    idx = PrefixIndex()
    idx.apply(1, RouterStored(999, [(10, 100)]))
    assert idx.overlap([100]) == {} and idx.dropped_orphans == 1
