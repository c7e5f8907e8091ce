"""kvalign's engine/router views and page arithmetic of the live fuzz (kvalign/live/runs/fuzz/views.py).

The reuse values below were observed on the real engine (sglang 0.5.23, EAGLE3, page 16, through
dynamo.frontend 1.6.1's ``/v1/completions``): a 40-token prompt repeated reported
``cached_tokens`` 32; a 33-token prompt whose two pages were held reported 16 (SGLang computes the
last token, so it never reuses the page that would cover the whole prompt), with the router
crediting 2 blocks (``kv_hit_rate`` 2/3); an 18-token prompt sharing 17 tokens reported 16.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvalign.model.hashing import block_hashes
from kvalign.live.runs.fuzz.views import (
    common_blocks,
    credited_blocks,
    engine_cached_tokens,
    engine_reusable_pages,
    isl_blocks,
    last_page_overcredit,
    overlaps,
)

B = 16
# (prompt tokens, leading pages held, cached_tokens the live engine reported) -- observed live
LIVE_REUSE = [(40, 2, 32), (33, 2, 16), (18, 1, 16)]


def test_engine_reuse_matches_the_live_engine() -> None:
    for n, held, cached in LIVE_REUSE:
        assert engine_cached_tokens(held, n, B, eagle=True) == cached


def test_negative_control_whole_prompt_reuse_contradicts_the_live_engine() -> None:
    """A model that reuses every held page (no last-token rule) disagrees with the engine at 33."""
    naive = {n: B * min(held, (n - 1) // B) for n, held, _ in LIVE_REUSE}
    assert any(naive[n] != cached for n, _, cached in LIVE_REUSE)


@given(st.integers(1, 400), st.integers(0, 30), st.booleans())
def test_reuse_never_covers_the_last_token(n: int, held: int, eagle: bool) -> None:
    cached = engine_cached_tokens(held, n, B, eagle=eagle)
    assert cached % B == 0 and cached <= n - 1 and cached <= held * B
    assert engine_reusable_pages(n, B, eagle=eagle) <= engine_reusable_pages(n + 1, B, eagle=eagle)


def test_router_credit_round_trips_kv_hit_rate() -> None:
    assert isl_blocks(33, B) == 3 and credited_blocks(2 / 3, 33, B) == 2
    assert credited_blocks(0.6, 75, B) == 3 and credited_blocks(None, 1, B) is None


@given(st.integers(1, 400), st.data())
def test_credit_is_recovered_exactly_for_every_k_over_the_prompt_blocks(n: int, data: st.DataObject) -> None:
    isl = isl_blocks(n, B)
    k = data.draw(st.integers(0, isl))
    assert credited_blocks(k / isl, n, B) == k


def test_negative_control_a_rate_over_another_denominator_is_no_credit() -> None:
    """A router dividing by another denominator (2 of 3 hashable blocks of a 49-token prompt,
    which has 4 prompt blocks) reports 2/3: no k/4, so no credit, not the nearest count (3)."""
    assert credited_blocks(2 / 3, 49, B) is None
    assert credited_blocks(0.5 + 1e-9, 49, B) is None


@given(st.integers(1, 30), st.booleans())
def test_last_page_rule_allows_exactly_one_page_at_a_boundary(k: int, eagle: bool) -> None:
    n = k * B + (1 if eagle else 0)  # a prompt that ends exactly at a page boundary
    full = k
    assert last_page_overcredit(full * B, (full - 1) * B, n, B, eagle=eagle)
    # nothing else: equal numbers are not an over-credit, two pages is too many, one token off the
    # boundary has no uncovered page, and the other key mode's boundary is not this one's
    assert not last_page_overcredit(full * B, full * B, n, B, eagle=eagle)
    assert not last_page_overcredit(full * B, (full - 2) * B, n, B, eagle=eagle)
    assert not last_page_overcredit(full * B, (full - 1) * B, n + 1, B, eagle=eagle)
    assert not last_page_overcredit((full - 1) * B, (full - 2) * B, n, B, eagle=eagle)  # not every block credited


def test_last_page_rule_matches_the_live_33_token_prompt() -> None:
    """Observed live (see the module docstring): 33 tokens, router 2 blocks (32 tokens), engine 16."""
    assert last_page_overcredit(32, 16, 33, B, eagle=True)
    assert not last_page_overcredit(32, 16, 33, B, eagle=False)  # plain keys: 33 is not a boundary


def test_common_blocks_follow_the_key_windows() -> None:
    a = list(range(100, 150))
    b = a[:33] + [1] * 17
    assert common_blocks(a, b, B, eagle=False) == 2  # tokens 0..31 equal
    assert common_blocks(a, b, B, eagle=True) == 2  # windows [0,16] and [16,32] equal
    c = a[:32] + [1] * 18
    assert common_blocks(a, c, B, eagle=False) == 2 and common_blocks(a, c, B, eagle=True) == 1
    assert common_blocks(a, [9] + a[1:], B, eagle=True) == 0


def _stored(tokens: list[int], parent: int | None, hashes: list[int]) -> BlockStored:
    pairs = [[tokens[i], tokens[i + 1]] for i in range(len(tokens) - 1)]
    return BlockStored(hashes, parent, pairs[: B * len(hashes)], B)


def _batch(*events: object) -> EventBatch:
    return EventBatch(0.0, list(events), 0, "map")


def test_overlaps_follow_stores_removals_and_clears_mark_by_mark() -> None:
    toks = list(range(10, 10 + 3 * B + 1))
    q = block_hashes(toks, B, eagle=True)
    batches = [_batch(_stored(toks, None, [101, 102])), _batch(_stored(toks[2 * B:], 102, [103])),
               _batch(BlockRemoved([103])), _batch(AllBlocksCleared())]
    assert overlaps(batches, q, B, 0, 4) == [0, 2, 3, 2, 0]
    assert overlaps(batches, q, B, 2, 2) == [3]


def test_an_orphan_store_after_a_lost_batch_holds_nothing() -> None:
    """The router view after the hop lost the parent's batch: the child's parent is unknown."""
    toks = list(range(10, 10 + 3 * B + 1))
    q = block_hashes(toks, B, eagle=True)
    assert overlaps([_batch(_stored(toks[2 * B:], 102, [103]))], q, B, 1, 1) == [0]


class Captured:
    def __init__(self, label: str, batch: EventBatch) -> None:
        self.label, self.batch = label, batch


class MemoryCapture:
    """The part of EventCapture the views read, holding batches a test lays out."""

    def __init__(self, batches: list[EventBatch]) -> None:
        self.endpoints = {"w": ""}
        self.items = [Captured("w", b) for b in batches]

    def snapshot(self) -> list[Captured]:
        return list(self.items)

    def count(self, label: str | None = None) -> int:
        return len(self.items)


def _seq(seq: int, *events: object) -> EventBatch:
    return EventBatch(0.0, list(events), 0, "map", seq=seq)


def test_delivered_view_counts_only_the_engine_batches_the_hop_delivered() -> None:
    from kvalign.live.runs.fuzz.views import DeliveredViews, WorkerViews

    toks = list(range(10, 10 + 3 * B + 1))
    q_blocks = block_hashes(toks, B, eagle=True)
    assert len(q_blocks) == 3
    engine = [_seq(1, _stored(toks, None, [101, 102])), _seq(2, _stored(toks[2 * B:], 102, [103]))]
    ev = WorkerViews(MemoryCapture(engine), B)
    all_delivered = DeliveredViews(ev, WorkerViews(MemoryCapture(engine), B))
    assert all_delivered.held("w", toks, eagle=True, lo=0, hi=2) == [0, 2, 3]
    first_lost = DeliveredViews(ev, WorkerViews(MemoryCapture(engine[1:]), B))  # seq 1 lost on the hop
    assert first_lost.held("w", toks, eagle=True, lo=1) == [0]  # the child is an orphan to the router


def test_delivered_view_keeps_the_engines_salt_when_the_hop_strips_it() -> None:
    """A tenant's pages: held under its namespace by the engine's content, whatever the hop did;
    the hop's own (stripped) output holds them under no tenant (the negative control's contrast)."""
    from dataclasses import replace

    from kvalign.live.runs.fuzz.views import DeliveredViews, WorkerViews

    toks = list(range(10, 10 + 2 * B + 1))
    salted = _seq(1, replace(_stored(toks, None, [101, 102]), cache_salt="tenant-a"))
    stripped = _seq(1, _stored(toks, None, [101, 102]))
    engine, router = WorkerViews(MemoryCapture([salted]), B), WorkerViews(MemoryCapture([stripped]), B)
    assert DeliveredViews(engine, router).held("w", toks, eagle=True, lo=1, namespace="tenant-a") == [2]
    assert router.held("w", toks, eagle=True, lo=1, namespace="tenant-a") == [0]
    assert router.held("w", toks, eagle=True, lo=1) == [2]
