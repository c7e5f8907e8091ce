"""Two routing candidates under one real ``KvRouter`` (the set-up ``kvalign.verify.engine.impact`` measures in).

Each rank's SGLang events reach the router through its own Dynamo relay and are credited to that
rank only; the router's ``best_worker`` picks the rank that holds the prompt. The negative control
tags rank 1's batches with rank 0 (a publisher that ignores its rank): Dynamo's relay drops them as
disagreeing with their source, so the set-up would measure nothing, and the pair refuses to start.
"""

from __future__ import annotations

import pytest

from kvalign.oracles.base import OracleUnavailable


def _cache_events(tokens: list[int]) -> list:
    from kvalign.oracles.sglang import SglangRadixCache

    cache = SglangRadixCache(4, eagle=False)
    cache.take_raw_events()
    cache.insert(tokens)
    return cache.take_raw_events()


def test_each_rank_is_credited_its_own_pages_and_picked_for_them(hicache_router_path):
    from kvalign.oracles.router_pair import RouterPair

    pair = RouterPair(hicache_router_path, 4, False)
    try:
        prompt = [900_001 + i for i in range(8)] + [7]
        pair.publish(1, _cache_events(prompt[:8]))
        pair.settle(prompt, {0: (0, 0), 1: (2, 0)})
        assert pair.choice(prompt) == 1 and pair.weight == hicache_router_path.host_weight
    finally:
        pair.close()


def test_a_tie_is_routed_both_ways_and_a_choice_one_way(hicache_router_path):
    """Issue 43: with both ranks credited nothing the router breaks the tie at random, so one best_worker call
    is a coin toss; routed ROUTES times it splits. The negative control: rank 1 holding the prompt is picked
    every time (the split comes from the tie, not from the repetition)."""
    from kvalign.oracles.router_pair import ROUTES, RouterPair

    pair = RouterPair(hicache_router_path, 4, False)
    try:
        prompt = [910_001 + i for i in range(8)] + [7]
        pair.settle(prompt, {0: (0, 0, 0), 1: (0, 0, 0)})
        tie = pair.picks(prompt)
        assert sum(tie) == ROUTES and min(tie) > 0, tie
        pair.publish(1, _cache_events(prompt[:8]))
        pair.settle(prompt, {0: (0, 0), 1: (2, 0)})
        assert pair.picks(prompt) == (0, ROUTES)
    finally:
        pair.close()


def test_negative_control_a_rank_tagged_as_another_is_dropped(hicache_router_path, monkeypatch):
    from kvalign.oracles import router_pair

    real = router_pair.SglangPublisher
    monkeypatch.setattr(router_pair, "SglangPublisher", lambda attn_dp_rank=0: real(attn_dp_rank=0))
    monkeypatch.setattr(router_pair, "SETTLE_TIMEOUT_S", 1.5)
    with pytest.raises(OracleUnavailable, match=r"never indexed rank\(s\) \[1\]"):
        router_pair.RouterPair(hicache_router_path, 4, False)
