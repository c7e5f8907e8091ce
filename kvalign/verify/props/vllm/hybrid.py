"""The ``hybrid`` row of ``check --engine vllm``: a hybrid model's groups on vLLM's real ``KVCacheManager``.

A hybrid model (full attention + sliding window) has two KV cache groups in one block pool
(``HybridKVCacheCoordinator``); vLLM publishes each group's stores and removals apart, tagged ``group_idx``
and ``kv_cache_spec_kind``, with the *same* block hashes in both groups. Dynamo 1.6.1's relay keeps only
full-attention groups (their removals too), so the router's index is vLLM's full-attention group. vLLM's own
hit needs both: the full-attention blocks of the prefix and the sliding window's blocks just before its end.

A Mamba hybrid (variant ``mamba``) is the same check on a full-attention + Mamba cache: vLLM's Mamba group keeps
a state only at a block boundary where a prefill step ended (``'align'``, vLLM's default for a Mamba model with
prefix caching), and publishes its stores tagged ``mamba``, which the relay skips; vLLM's hit needs that state at
the prefix's end, so where none is kept vLLM reuses less than the router credits (:data:`MAMBA_GAP_CAUSE`).

The row checks, after each prompt of a generated sequence (a small pool, so both groups evict), that the
router's index holds every block vLLM's full-attention group holds and none it removed, and before each prompt that vLLM
never reuses more than the router credits (``B * min(R, (n - 1) // B)``). Where vLLM reuses *less* (its
window's blocks were evicted while the full-attention blocks stayed), the router over-credits: that gap is the
finding :data:`GAP_CAUSE`, measured by :func:`credit_gap` and shown by tests, not failed here. A negative
control strips the group tags on the hop (a relay that takes every group for full attention): the sliding
window's stores of the shared hashes then keep blocks the full-attention group removed in the router's index,
and the row fails ``INGEST_STALE``.

Dynamo 1.0.2's relay reads no group tags (its core names neither ``group_idx`` nor ``kv_cache_spec_kind``) and its
index keeps one entry per hash, dropped at the first ``BlockRemoved`` of it: there the control changes nothing, and
a block vLLM's full-attention group holds twice (computed again where the window missed) leaves the router at the
first eviction of a copy, with everything stored below it. The row names that :data:`COPIES_CAUSE`, and its control
expects it on such a release (:func:`control_cause`), as the tenants control expects ``NAMESPACE_DROPPED`` on a
release that already drops the namespace (docs/vllm.md, the 1.0.2 rows).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from kvalign.model.causes import Cause
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.props.vllm.strategies import Served, fresh_base

#: the hybrid engine's pool (both groups share it; the window is two blocks)
NUM_BLOCKS = 14
#: what the router's over-credit of a hybrid prompt is (the SGLang hybrid property's cause for the same gap)
GAP_CAUSE = Cause.SWA_STATE_NOT_REUSABLE
#: what the row names a full-attention block the router dropped at a BlockRemoved of another copy of its hash (of
#: the full-attention group's second copy, or of the window group's where the relay reads no group tags): measured on
#: Dynamo 1.0.2, whose relay reads no group tags and whose index keeps no copy count
COPIES_CAUSE = Cause.VLLM_BLOCK_COPIES_UNCOUNTED
#: the same gap on a Mamba hybrid (variant ``mamba``): vLLM keeps a Mamba state only where a prefill step ended
MAMBA_GAP_CAUSE = Cause.MAMBA_STATE_NOT_REUSABLE


def full_attention_blocks(live: Counter[int], gone: set[int], events: list[dict[str, Any]],
                          copies_removed: set[int] | None = None) -> None:
    """Fold vLLM's events into the copies of each block hash its full-attention group (``group_idx`` 0) holds
    (``live``) and the hashes it no longer holds a copy of (``gone``), of the blocks stored since the fold began
    (each example's own, in its fresh token range: earlier ones may have copies it never saw). A group can hold
    two blocks of one hash:
    where the sliding window misses, vLLM computes a prefix again and caches a second copy of a full-attention
    block it still holds; evicting one copy publishes a ``BlockRemoved`` while the other stays. ``copies_removed``
    collects the hashes a ``BlockRemoved`` (of either group) named while the full-attention group kept a copy: the
    evidence for :data:`COPIES_CAUSE`."""
    for e in events:
        if e.get("group_idx", 0) != 0:
            if copies_removed is not None and e["type"] == "BlockRemoved":
                copies_removed.update(h for h in e["block_hashes"] if h in live)
            continue
        if e["type"] == "BlockStored":
            live.update(e["block_hashes"])
            gone.difference_update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            for h in e["block_hashes"]:
                if h in live:  # a block stored before the fold began is not followed
                    live[h] -= 1
                    if live[h] > 0 and copies_removed is not None:
                        copies_removed.add(h)
                    if live[h] <= 0:
                        del live[h]
                        gone.add(h)
        elif e["type"] == "AllBlocksCleared":
            gone.update(live)
            live.clear()


def credit_gap(worker: Any, tokens: list[int]) -> tuple[int, int]:
    """``(blocks the router credits, blocks vLLM reuses)`` for ``tokens`` now."""
    b = worker.engine.block_size
    return min(worker.overlap(tokens), (len(tokens) - 1) // b), worker.engine.match(tokens) // b


def hybrid_body(worker: Any, gaps: list[tuple[int, int]] | None = None) -> Any:
    """Router index = vLLM's full-attention group; vLLM never reuses more than the router credits. ``gaps``
    collects every ``(credited, reused)`` where vLLM reuses less (the finding's measurements)."""

    def body(seq: list[Served]) -> None:
        base, b = fresh_base(), worker.engine.block_size
        live: Counter[int] = Counter()
        gone: set[int] = set()
        copies_removed: set[int] = set()
        for i, served in enumerate(seq):
            tokens = served.tokens(base, b)
            credited, reused = credit_gap(worker, tokens)
            if reused > credited:
                raise Mismatch("hybrid", f"prompt {i}: vLLM reuses {reused} blocks, the router credits {credited}",
                               Cause.EVENTS_DROPPED, seq)
            if reused < credited and gaps is not None:
                gaps.append((credited, reused))
            worker.engine.prefill(tokens)
            full_attention_blocks(live, gone, worker.sync(), copies_removed)
            indexed = {h for _p, h, _k in worker.dump()}
            if set(live) - indexed:
                missing = set(live) - indexed
                copies = missing & copies_removed
                why = (f" ({len(copies)} of them after a BlockRemoved of another copy of its hash)" if copies else "")
                raise Mismatch("hybrid", f"after prompt {i}: {len(missing)} of the {len(live)} blocks vLLM's "
                                         f"full-attention group holds are not indexed{why}",
                               COPIES_CAUSE if copies else Cause.EVENTS_DROPPED, seq)
            if gone & indexed:
                raise Mismatch("hybrid", f"after prompt {i}: {len(gone & indexed)} blocks vLLM's full-attention group "
                                         "removed are still indexed", Cause.INGEST_STALE, seq)

    return body


def untag_groups(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A relay that takes every group for full attention: the group tags removed."""
    for e in events:
        e.pop("group_idx", None)
        e.pop("kv_cache_spec_kind", None)
        e.pop("kv_cache_spec_sliding_window", None)
    return events


#: the control's sequence: a 5-block prompt, then two whose allocation evicts sliding-window blocks of it
CONTROL_SEQUENCE = [Served((0, 1, 2, 0, 1), 1), Served((1, 1, 1), 1), Served((2, 2, 2), 1)]
#: appended to the control's sequence (the search's shrunk counterexample on Dynamo 1.0.2): one block served three
#: times, then a prompt starting with it, whose allocation evicts one of the full-attention group's copies of it; a
#: relay that takes every group for full attention and keeps no copy count drops the block vLLM still holds. A relay
#: that counts copies fails the control earlier (``CONTROL_SEQUENCE``), so this part never runs there.
COPIES_SEQUENCE = [Served((0,), 0)] * 3 + [Served((0, 0, 0, 0, 0), 0)]
#: the Mamba variant's (the search's shrunk counterexample under ``untag_groups``): a 2-block prompt, then its first
#: block alone, served again and again; the Mamba group's stores of that block's hash, untagged, keep it indexed
#: after the full-attention group removed its last copy
MAMBA_CONTROL_SEQUENCE = [Served((0, 0), 0)] + [Served((0,), 0)] * 5


def reads_group_tags() -> bool:
    """Whether the running Dynamo's relay reads vLLM's group tags: its compiled core names ``kv_cache_spec_kind``
    (1.3.1-1.6.1's does; 1.0.2's names neither it nor ``group_idx``, and takes every group for full attention)."""
    import dynamo._core

    return b"kv_cache_spec_kind" in Path(dynamo._core.__file__).read_bytes()


def control_cause(tagged: bool) -> Cause:
    """What ``untag_groups`` must fail with: ``INGEST_STALE`` (a relay reading the tags, whose index counts copies,
    then keeps the window's stores of blocks full attention removed), or, where the relay reads no tags and so
    already does what the control does, the release's own cause :data:`COPIES_CAUSE` (as the tenants control
    expects ``NAMESPACE_DROPPED`` on a release that already drops the namespace)."""
    return Cause.INGEST_STALE if tagged else COPIES_CAUSE


def row(path: Any, b: int, n: int, seed: int | None, variant: str = "base") -> RowResult:
    """The ``hybrid`` row on a hybrid vLLM engine of its own: full attention + a window of two blocks (``base``)
    or + a Mamba group in vLLM's default ``'align'`` mode (``mamba``)."""
    from hypothesis import strategies as st

    from kvalign.verify.props.vllm.running import control_run, on_engine, search_row
    from kvalign.verify.props.vllm.strategies import sequences

    mamba = variant == "mamba"
    options: dict[str, Any] = {"mamba": True} if mamba else {"sliding_window": 2 * b}
    control_seq = MAMBA_CONTROL_SEQUENCE if mamba else CONTROL_SEQUENCE + COPIES_SEQUENCE
    expected = Cause.INGEST_STALE if mamba else control_cause(reads_group_tags())
    #: the known counterexample first (Hypothesis generates a ``one_of``'s first branch first): at the matrix's 5
    #: examples the generated ones alone missed Dynamo 1.0.2's finding (seed 0 met it at its 31st)
    strategy = sequences(b) if mamba else st.one_of(st.just(COPIES_SEQUENCE), sequences(b))

    def rows(worker: Any) -> list[RowResult]:
        return [search_row("hybrid", hybrid_body(worker), strategy, n, seed,
                           ("untag_groups (the relay takes every group for full attention)",
                            control_run(worker, hybrid_body(worker), control_seq, seed, untag_groups),
                            expected), variant=variant)]

    return on_engine([("hybrid", variant)], path, b, NUM_BLOCKS, rows, **options)[0]
