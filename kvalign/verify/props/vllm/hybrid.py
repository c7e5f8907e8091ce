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
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvalign.model.causes import Cause
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.props.vllm.strategies import Served, fresh_base

#: the hybrid engine's pool (both groups share it; the window is two blocks)
NUM_BLOCKS = 14
#: what the router's over-credit of a hybrid prompt is (the SGLang hybrid property's cause for the same gap)
GAP_CAUSE = Cause.SWA_STATE_NOT_REUSABLE
#: the same gap on a Mamba hybrid (variant ``mamba``): vLLM keeps a Mamba state only where a prefill step ended
MAMBA_GAP_CAUSE = Cause.MAMBA_STATE_NOT_REUSABLE


def full_attention_blocks(live: Counter[int], gone: set[int], events: list[dict[str, Any]]) -> None:
    """Fold vLLM's events into the copies of each block hash its full-attention group (``group_idx`` 0) holds
    (``live``) and the hashes it no longer holds a copy of (``gone``), of the blocks stored since the fold began
    (each example's own, in its fresh token range: earlier ones may have copies it never saw). A group can hold
    two blocks of one hash:
    where the sliding window misses, vLLM computes a prefix again and caches a second copy of a full-attention
    block it still holds; evicting one copy publishes a ``BlockRemoved`` while the other stays."""
    for e in events:
        if e.get("group_idx", 0) != 0:
            continue
        if e["type"] == "BlockStored":
            live.update(e["block_hashes"])
            gone.difference_update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            for h in e["block_hashes"]:
                if h in live:  # a block stored before the fold began is not followed
                    live[h] -= 1
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
        for i, served in enumerate(seq):
            tokens = served.tokens(base, b)
            credited, reused = credit_gap(worker, tokens)
            if reused > credited:
                raise Mismatch("hybrid", f"prompt {i}: vLLM reuses {reused} blocks, the router credits {credited}",
                               Cause.EVENTS_DROPPED, seq)
            if reused < credited and gaps is not None:
                gaps.append((credited, reused))
            worker.engine.prefill(tokens)
            full_attention_blocks(live, gone, worker.sync())
            indexed = {h for _p, h, _k in worker.dump()}
            if set(live) - indexed:
                missing = len(set(live) - indexed)
                raise Mismatch("hybrid", f"after prompt {i}: {missing} of the {len(live)} blocks vLLM's full-attention "
                                         "group holds are not indexed", Cause.EVENTS_DROPPED, seq)
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
#: the Mamba variant's (the search's shrunk counterexample under ``untag_groups``): a 2-block prompt, then its first
#: block alone, served again and again; the Mamba group's stores of that block's hash, untagged, keep it indexed
#: after the full-attention group removed its last copy
MAMBA_CONTROL_SEQUENCE = [Served((0, 0), 0)] + [Served((0,), 0)] * 5


def row(path: Any, b: int, n: int, seed: int | None, variant: str = "base") -> RowResult:
    """The ``hybrid`` row on a hybrid vLLM engine of its own: full attention + a window of two blocks (``base``)
    or + a Mamba group in vLLM's default ``'align'`` mode (``mamba``)."""
    from kvalign.verify.props.vllm.running import control_run, on_engine, search_row
    from kvalign.verify.props.vllm.strategies import sequences

    mamba = variant == "mamba"
    options: dict[str, Any] = {"mamba": True} if mamba else {"sliding_window": 2 * b}
    control_seq = MAMBA_CONTROL_SEQUENCE if mamba else CONTROL_SEQUENCE

    def rows(worker: Any) -> list[RowResult]:
        return [search_row("hybrid", hybrid_body(worker), sequences(b), n, seed,
                           ("untag_groups (the relay takes every group for full attention)",
                            control_run(worker, hybrid_body(worker), control_seq, seed, untag_groups),
                            Cause.INGEST_STALE), variant=variant)]

    return on_engine([("hybrid", variant)], path, b, NUM_BLOCKS, rows, **options)[0]
