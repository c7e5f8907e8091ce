"""The fuzz's HiCache checks (kvalign/live/runs/fuzz/{tiers,hicache}.py) on numbers the live cluster gave.

The router's (device, host) split is recovered from its two surfaces as Dynamo 1.6.1 reported them
on a live page-4 HiCache cluster (a 21-token EAGLE prompt: 4 host-only blocks -> kv_hit_rate 0.5 and
16 raw tokens credited; 5 host-only -> 0.625 and 20; 5 device -> 5/6 and 20). The engine side is
SGLang's reuse for a residency under its scheduler's cap, loaded all or nothing.
"""

from __future__ import annotations

import pytest

from kvalign.live.runs.fuzz.hicache import (
    EVALUATION_ORDER, LOAD_BACK_THRESHOLD, TierObservation, cause, evaluate_tiers, requery_record, router_tiers,
)
from kvalign.live.runs.fuzz.invariants import INVARIANTS, Tally, evaluate
from kvalign.live.runs.fuzz.tiers import Residency, TierIndex
from kvalign.live.wire.client import Completion
from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvalign.model.hashing import block_hashes

B = 4


@pytest.mark.parametrize("raw, rate, split", [(16, 0.5, (0, 4)), (20, 0.625, (0, 5)), (20, 5 / 6, (5, 0)),
                                              (16, 3.5 / 6, (2, 2)), (0, 0.0, (0, 0))])
def test_the_router_split_is_the_one_that_fits_both_surfaces(raw, rate, split):
    assert router_tiers(raw, rate, 21, B, 0.75) == split


@pytest.mark.parametrize("raw, rate", [(20, 0.7), (18, 0.5), (None, 0.5), (16, None)])
def test_negative_control_surfaces_that_no_split_fits_give_none(raw, rate):
    assert router_tiers(raw, rate, 21, B, 0.75) is None


def _stored(hashes, parent, tokens, medium):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=B, medium=medium)


def test_residency_follows_the_tiers_sglang_publishes():
    """A 4-page chain stored on device and host; the device drops its last two pages (a device
    eviction); then the host drops the last one (a host eviction); then everything is cleared."""
    tokens = list(range(100, 117))  # plain keys: 4 pages of 4
    query = block_hashes(tokens[:16], B, eagle=False)
    idx = TierIndex(B)
    for medium in ("GPU", "CPU_PINNED"):
        idx.apply(_stored([1, 2, 3, 4], None, tokens[:16], medium))
    assert idx.residency(query) == Residency(4, 0)
    idx.apply(BlockRemoved(block_hashes=[3, 4], medium="GPU"))
    assert idx.residency(query) == Residency(2, 2)
    idx.apply(BlockRemoved(block_hashes=[4], medium="CPU_PINNED"))
    assert idx.residency(query) == Residency(2, 1)
    idx.apply(BlockRemoved(block_hashes=[1, 2], medium="GPU"))
    assert idx.residency(query) == Residency(0, 3)
    idx.apply(AllBlocksCleared())
    assert idx.residency(query) == Residency(0, 0)


def test_negative_control_a_medium_the_router_indexes_nowhere_counts_nowhere():
    tokens = list(range(100, 109))
    idx = TierIndex(B)
    idx.apply(_stored([1, 2], None, tokens[:8], "NVME"))
    assert idx.residency(block_hashes(tokens[:8], B, eagle=False)) == Residency(0, 0)


def tobs(n: int, residency: Residency, *, raw: int, rate: float, engine: int, split: tuple[int, int],
         predicted: Residency | None = None, b: int = B, faulted: bool = False) -> TierObservation:
    c = Completion(n, engine, [0], 7, 7, rate)
    predicted = predicted or residency
    return TierObservation(1, list(range(n)), c, "worker0", False, b, True, predicted.held, residency.held, engine,
                           hop_faulted=faulted, residency=residency, router_view=predicted, router_raw=raw, weight=0.75,
                           engine_split=split)


def judge(o: TierObservation) -> list[str]:
    tally = Tally()
    failures = sorted(evaluate(o, tally) + evaluate_tiers(o, tally), key=lambda f: EVALUATION_ORDER.index(f[0]))
    return [name for name, _ in failures]


def test_a_loaded_host_stretch_credited_by_the_router_passes():
    """21 tokens (EAGLE: the cap is 4 pages), 2 device + 3 host-only pages: the engine loads the 2
    host pages inside the cap (8 tokens here would be declined; 12 would not) -- page 4, so 3
    host pages inside the cap need a longer prompt: 25 tokens (cap 5 pages)."""
    o = tobs(25, Residency(2, 3), raw=20, rate=(2 + 0.75 * 3) / 7, engine=20, split=(8, 12))
    assert judge(o) == [] and not o.declined
    assert requery_record(o) == {"request": 1, "prompt_tokens": 25, "device_tokens": 8, "host_only_tokens": 12,
                                 "loaded_tokens": 12, "router_tokens": 20, "engine_tokens": 20,
                                 "threshold_predicts": "load", "engine_did": "load"}


def test_a_declined_host_stretch_the_router_credits_is_host_credit_not_servable():
    """The issue's counterexample, EAGLE form: 2 device + 2 host-only pages (8 tokens < 10), a
    21-token prompt whose cap (4 pages) covers them all: SGLang loads 0 back and re-prefills."""
    o = tobs(21, Residency(2, 2), raw=16, rate=3.5 / 6, engine=8, split=(8, 0))
    assert judge(o) == ["router_credits_engine_reuse"] and o.declined
    assert cause(o) == "HOST_CREDIT_NOT_SERVABLE"
    assert (o.router_tokens, o.engine_tokens) == (16, 8)
    assert requery_record(o)["threshold_predicts"] == "decline" == requery_record(o)["engine_did"]


def test_the_last_page_under_the_cap_stays_the_last_page_rule():
    """5 host-only pages of a 21-token prompt: the cap takes 4 (16 tokens >= 10, loaded), the router
    credits 5: one page over, exactly the last-page rule, not a host finding."""
    tally = Tally()
    o = tobs(21, Residency(0, 5), raw=20, rate=0.625, engine=16, split=(0, 16))
    assert evaluate(o, tally) == [] and evaluate_tiers(o, tally) == []
    assert tally.last_page_overcredits == 1 and cause(o) is None


def test_negative_control_a_router_filing_host_pages_as_device_fails_the_tier_check():
    o = tobs(25, Residency(2, 3), raw=20, rate=5 / 7, engine=20, split=(8, 12))
    assert o.router_split == (5, 0)
    assert judge(o) == ["router_tiers_match_engine"] and cause(o) == "TIER_RESIDENCY"


def test_negative_control_a_partial_load_back_fails_the_engine_check():
    o = tobs(25, Residency(2, 3), raw=20, rate=(2 + 0.75 * 3) / 7, engine=16, split=(8, 8))
    assert judge(o)[0] == "engine_matches_index"


def test_the_tier_invariant_is_evaluated_after_the_users_question():
    assert INVARIANTS.index("router_credits_engine_reuse") < INVARIANTS.index("router_tiers_match_engine")
    assert EVALUATION_ORDER.index("router_credits_engine_reuse") < EVALUATION_ORDER.index("router_tiers_match_engine")
    assert set(EVALUATION_ORDER) == set(INVARIANTS)


@pytest.mark.slow  # builds SGLang's real UnifiedRadixCache with HiCache on
def test_the_load_back_threshold_is_the_one_sglangs_init_hicache_sets():
    from kvalign.oracles.hicache import HiCacheEngine, available_cores

    for policy in ("write_through", "write_back"):
        engine = HiCacheEngine(B, eagle=True, core=available_cores()[0], policy=policy, host_tokens=64)
        assert engine.load_back_threshold == LOAD_BACK_THRESHOLD


def test_a_worker_that_reused_tokens_but_exports_no_tier_counter_is_a_missing_surface():
    from kvalign.live.runs.fuzz.hicache import EngineTiers
    from kvalign.live.runs.fuzz.surfaces import SurfaceMissing

    tiers = EngineTiers({"worker0": "http://127.0.0.1:1/metrics"})
    assert tiers.split("worker0", None, None, 0) == (0, 0)  # nothing counted yet, nothing reused: no sample is right
    assert tiers.split("worker0", {"device": 8.0}, {"device": 16.0, "host": 12.0}, 20) == (8, 12)
    with pytest.raises(SurfaceMissing, match="exports no sglang:cached_tokens_total after reusing 8 tokens"):
        tiers.split("worker0", None, None, 8)


def test_the_raw_credit_counter_sums_the_publishing_phases_not_the_decode_hop():
    from kvalign.live.runs.fuzz.hicache import selected_tokens
    from kvalign.live.wire.metrics import MetricsSnapshot, Sample

    name = "dynamo_component_router_kv_selected_cached_prefix_tokens_total"
    snap = MetricsSnapshot([Sample(name, (("phase", "prefill"), ("worker_id", "a")), 20.0),
                            Sample(name, (("phase", "aggregated"), ("worker_id", "b")), 4.0),
                            Sample(name, (("phase", "decode"), ("worker_id", "c")), 99.0)])
    assert selected_tokens(snap) == 24.0
    assert selected_tokens(MetricsSnapshot([])) is None


def test_a_hop_that_lost_the_device_store_is_judged_against_what_the_router_was_told():
    """Seen live (page 16, write_through): the hop lost a fresh worker's device-store batch, its host
    copy arrived, so the router held the 4 pages as host-only while the engine reused them from the
    device. That request is hop-faulted: its tiers are judged against the router view."""
    live = dict(raw=64, rate=3.0 / 6, engine=64, split=(64, 0), predicted=Residency(0, 4), b=16)
    o = tobs(91, Residency(4, 0), faulted=True, **live)
    assert o.router_split == (0, 4)
    tally = Tally()
    assert evaluate_tiers(o, tally) == [] and tally.checked["router_tiers_match_engine"] == 1
    # negative control: the same request judged against the engine fails
    assert [n for n, _ in evaluate_tiers(tobs(91, Residency(4, 0), **live), Tally())] == ["router_tiers_match_engine"]
