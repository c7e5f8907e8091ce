"""Naming the engine's own events as the cause (kvalign/streams/engine_reuse.py).

Streams are built the way SGLang publishes them (EAGLE bigram pages of 16, its own SHA-256 chain of
block hashes, recomputed by :func:`kvalign.model.sglang_keys.engine_block_hashes`), then reshaped by
the very transforms kvalign injects into the live publisher (:func:`reshape` of
kvalign/standins/sglang_cpu/publisher_faults.py): each harmful fault is named with the pages in
question, each benign one explains the engine's reuse like the honest stream (the negative controls).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvalign.model.causes import Cause
from kvalign.model.events import BlockRemoved, BlockStored, EventBatch
from kvalign.model.sglang_keys import engine_block_hashes, page_count, page_units
from kvalign.standins.sglang_cpu.publisher_faults import reshape
from kvalign.streams.capture import CaptureWriter
from kvalign.streams.diagnose import RouterSettings, diagnose
from kvalign.streams.engine_reuse import explain_engine_reuse, read_capture

B = 16
A = list(range(1000, 1050))  # 50 tokens: 3 bigram pages
AB = [*A, *range(2000, 2020)]  # A extended to 70 tokens: 4 pages, the 4th new
REUSED_AB = 64  # AB again: 4 pages held, at most floor((70-2)/16) = 4 reusable (SGLang computes the last token)


def store(tokens: list[int], cached: int) -> BlockStored:
    """What SGLang publishes when a request of ``tokens`` finds ``cached`` pages and stores the rest."""
    hashes = engine_block_hashes(tokens, B, eagle=True)
    units = page_units(tokens, B, eagle=True)
    n = page_count(len(tokens), B, eagle=True)
    return BlockStored(hashes[cached:n], hashes[cached - 1] if cached else None,
                       [u for page in units[cached:n] for u in page], B)


def batches(*event_lists: list) -> list[EventBatch]:
    return [EventBatch(float(i), list(evs), 0, "map", i) for i, evs in enumerate(event_lists)]


def stream(fault_a: str | None = None, fault_ab: str | None = None) -> list[EventBatch]:
    """A, then AB on the same worker, each store batch reshaped by a publisher fault."""
    out: list[list] = []
    for ev, fault in ((store(A, 0), fault_a), (store(AB, 3), fault_ab)):
        out += [[ev]] if fault is None else reshape(fault, [ev])
    return batches(*out)


def test_the_honest_stream_explains_the_engines_reuse() -> None:
    assert explain_engine_reuse(stream(), AB, REUSED_AB, B, eagle=True) is None


@pytest.mark.parametrize("fault_a, fault_ab", [("split", None), ("split", "split")])
def test_benign_reshapings_explain_the_reuse_like_the_honest_stream(fault_a, fault_ab) -> None:
    s = stream(fault_a, fault_ab)
    assert len(s) == 4  # A's 3 pages went out one batch each
    assert explain_engine_reuse(s, AB, REUSED_AB, B, eagle=True) is None


def test_merged_batches_explain_the_reuse() -> None:
    merged = batches([store(A, 0), store(AB, 3)])
    assert explain_engine_reuse(merged, AB, REUSED_AB, B, eagle=True) is None


def test_a_dropped_store_is_named_never_stored_with_its_pages() -> None:
    f = explain_engine_reuse(stream(fault_ab="drop_store"), AB, REUSED_AB, B, eagle=True)
    assert f is not None and f.cause is Cause.ENGINE_EVENTS_MISSING and f.kind == "never_stored"
    assert (f.first, f.last, f.held, f.reused) == (3, 3, 3, 4) and "page 3 (tokens [48, 64))" in f.detail
    f = explain_engine_reuse(stream(fault_a="drop_store"), AB, REUSED_AB, B, eagle=True)
    assert (f.kind, f.first, f.last, f.held) == ("never_stored", 0, 3, 0)


def test_a_wrong_parent_is_named_outside_the_chain() -> None:
    f = explain_engine_reuse(stream(fault_ab="wrong_parent"), AB, REUSED_AB, B, eagle=True)
    assert f is not None and f.cause is Cause.ENGINE_EVENTS_MISSING and f.kind == "outside_chain"
    assert (f.first, f.last) == (3, 3) and "a wrong parent hash" in f.detail and f.seq == 1
    f = explain_engine_reuse(stream(fault_a="wrong_parent"), AB, REUSED_AB, B, eagle=True)
    assert (f.kind, f.first) == ("outside_chain", 0) and "page 0 has no parent" in f.detail


def test_a_wrong_block_hash_is_named_from_the_store_that_names_the_true_one() -> None:
    """A's last page goes out under a wrong hash: A itself is held (pages are keyed by their tokens),
    but AB's store hangs under SGLang's true hash of page 2, which the stream never stored."""
    s = stream(fault_a="wrong_hash")
    assert explain_engine_reuse(s, A, 48, B, eagle=True) is None
    f = explain_engine_reuse(s, AB, REUSED_AB, B, eagle=True)
    assert f is not None and f.kind == "outside_chain" and (f.first, f.held) == (3, 3)
    assert "a wrong block hash" in f.detail and "SGLang's own hash of page 2" in f.detail


def test_stores_after_the_routing_mark_are_named_late() -> None:
    s = stream()
    f = explain_engine_reuse(s, AB, REUSED_AB, B, eagle=True, routed_at=1)  # routed before AB's store arrived
    assert f is not None and f.cause is Cause.ENGINE_EVENTS_LATE and f.kind == "late" and f.seq == 1
    assert explain_engine_reuse(s, AB, REUSED_AB, B, eagle=True, routed_at=2) is None


def test_a_removed_page_the_engine_still_reused_is_named() -> None:
    s = stream()
    hashes = engine_block_hashes(AB, B, eagle=True)
    s.append(EventBatch(9.0, [BlockRemoved([hashes[3]])], 0, "map", 2))
    f = explain_engine_reuse(s, AB, REUSED_AB, B, eagle=True)
    assert f is not None and f.kind == "removed" and f.first == 3 and f.seq == 2


def test_diagnose_names_the_engines_events_from_a_capture(tmp_path: Path) -> None:
    """``kvalign diagnose --engine-reused`` replays the recorded stream to the same cause; without the
    engine's count it has nothing to compare and keeps its router-side reading."""
    path = tmp_path / "w.capture.jsonl"
    w = CaptureWriter(str(path))
    for b in stream(fault_ab="wrong_parent"):
        w.write_batch(b)
    w.close()
    assert len(read_capture(str(path))) == 2
    d = diagnose(str(path), AB, RouterSettings(block_size=B), engine_reused=REUSED_AB)
    assert d.cause is Cause.ENGINE_EVENTS_MISSING and d.first_divergent == 3
    assert d.engine_reuse["kind"] == "outside_chain" and d.engine_reuse["pages"] == [3, 3]
    assert diagnose(str(path), AB, RouterSettings(block_size=B)).cause is not Cause.ENGINE_EVENTS_MISSING
    late = diagnose(str(path), A, RouterSettings(block_size=B), engine_reused=32, routed_at=0)
    assert late.cause is Cause.ENGINE_EVENTS_LATE


# ---- the other direction: the engine freed pages its stream still holds ----------------------------

C = list(range(3000, 3050))  # a prompt of 3 pages that evicts A (no page in common)


def evicting(fault: str | None = None) -> list[EventBatch]:
    """A, then C evicting A in the batch of C's store (SGLang publishes evictions with the stores that
    caused them), that batch reshaped by ``fault``."""
    removal = BlockRemoved(engine_block_hashes(A, B, eagle=True)[:3])
    second = [store(C, 0), removal]
    return batches([store(A, 0)], *([second] if fault is None else reshape(fault, second)))


def test_a_removal_the_engine_never_published_is_named_from_its_state() -> None:
    """The control: SGLang's publisher drops the eviction (the live fault ``drop_removal``); A sent
    again reuses nothing while the engine's own stream still holds its 3 pages."""
    f = explain_engine_reuse(evicting("drop_removal"), A, 0, B, eagle=True)
    assert f is not None and f.cause is Cause.ENGINE_REMOVALS_MISSING and f.kind == "never_removed", f
    assert (f.first, f.last, f.held, f.reused) == (0, 2, 3, 0) and "pages 0..2 (tokens [0, 48))" in f.detail


def test_the_honest_eviction_explains_the_engines_reuse() -> None:
    """The healthy twin: the removal published, the stream holds nothing of A, the engine reused nothing."""
    assert explain_engine_reuse(evicting(), A, 0, B, eagle=True) is None


def test_a_removal_published_after_the_routing_mark_is_late_not_missing() -> None:
    f = explain_engine_reuse(evicting(), A, 0, B, eagle=True, routed_at=1)
    assert f is not None and f.cause is Cause.ENGINE_EVENTS_LATE and f.kind == "removed_late" and f.seq == 1, f


def test_a_reuse_short_of_the_stream_only_by_sglangs_match_cap_is_no_finding() -> None:
    """SGLang matches at most N-2 bigrams: A's 50 tokens hold 3 pages, all matchable (48 <= 48); a
    49-token prefix of A holds 3 pages in the stream, of which only 2 are matchable."""
    assert explain_engine_reuse(batches([store(A, 0)]), A[:49], 32, B, eagle=True) is None
