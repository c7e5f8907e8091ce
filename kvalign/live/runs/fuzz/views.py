"""kvalign's two views of each live worker's cache, rebuilt from captured KV events.

* the **engine view** reads SGLang's own publisher: what the worker's radix cache holds;
* the **router view** (:class:`DeliveredViews`) is the engine's batches whose sequence numbers
  the hop delivered to Dynamo's relay: what an aligned router can know. A batch lost on the hop is
  missing from it; a batch the hop *altered* still counts with the engine's content, so the
  router disagreeing with it is a finding (the tenant negative control strips ``cache_salt``).

Each view is a worker's batches since its *epoch* (the example's start, or its last restart),
replayed through kvalign's :class:`~kvalign.model.relay.Relay` into a :class:`~kvalign.model.index.PrefixIndex`.
A prediction is taken at a *mark* (how many of the worker's batches had arrived); a request sent
while others were in flight may have been routed at any mark in a window, so views answer for
every mark in ``[lo, hi]``.

Page arithmetic (checked live against sglang 0.5.23 + dynamo 1.6.1, page/block size B):

* router: ``kv_hit_rate = credited / ceil(N / B)``; an EAGLE prompt of N tokens has
  ``floor((N-1)/B)`` hashable blocks (block k = raw tokens [kB, kB+B]);
* engine: SGLang matches at most the prompt minus its last token, so with h leading pages held
  it reuses ``B * min(h, floor((N-2)/B))`` tokens under EAGLE (bigram keys: N-1 tokens give N-2
  bigrams) and ``B * min(h, floor((N-1)/B))`` with plain keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from kvalign.model.events import EventBatch
from kvalign.model.hashing import block_hashes
from kvalign.model.index import PrefixIndex
from kvalign.live.wire.capture import EventCapture
from kvalign.model.relay import Relay

_WORKER = 0  # one index per worker view: the id inside it is arbitrary


def isl_blocks(n_tokens: int, block_size: int) -> int:
    """The router's denominator: prompt blocks counting a partial last one."""
    return math.ceil(n_tokens / block_size)


def credited_blocks(kv_hit_rate: float | None, n_tokens: int, block_size: int) -> int | None:
    """The blocks the router credited, recovered exactly from its reported ``kv_hit_rate``.

    Dynamo reports ``overlap / isl_blocks`` as an f64, so the credit is the one integer k in
    ``0..isl_blocks`` whose ``k / isl_blocks`` *is* that float. No rounding: a rate that is no such
    fraction (a router dividing by another denominator) gives None, which every check treats as a
    disagreement rather than the nearest count.
    """
    if kv_hit_rate is None:
        return None
    isl = isl_blocks(n_tokens, block_size)
    if isl == 0:
        return 0 if kv_hit_rate == 0 else None
    k = round(kv_hit_rate * isl)
    return k if 0 <= k <= isl and k / isl == kv_hit_rate else None


def last_page_overcredit(router_tokens: int, engine_tokens: int, n_tokens: int, block_size: int, *,
                         eagle: bool) -> bool:
    """True when ``router_tokens`` exceeds ``engine_tokens`` by exactly SGLang's last-page rule.

    SGLang always computes the prompt's last token, so it never reuses the page that would cover
    the whole prompt; Dynamo's router still credits it. That page exists only when the prompt ends
    exactly at a page boundary: EAGLE (bigram pages of B+1 raw tokens) when ``(N-1) % B == 0``,
    plain keys when ``N % B == 0``. Then, and only then, the router may credit every hashable block
    (``(N-1)/B`` or ``N/B``) while the engine reuses one page less; any other difference is not
    allowed.
    """
    b = block_size
    units = n_tokens - 1 if eagle else n_tokens
    if units <= 0 or units % b:
        return False
    full = units // b
    return router_tokens == full * b and engine_tokens == (full - 1) * b


def engine_reusable_pages(n_tokens: int, block_size: int, *, eagle: bool) -> int:
    """The most leading pages SGLang reuses for an N-token prompt: it always computes the last
    token, so the match covers at most N-1 raw tokens (N-2 bigrams under EAGLE)."""
    units = n_tokens - 2 if eagle else n_tokens - 1
    return max(units, 0) // block_size


def engine_cached_tokens(held_pages: int, n_tokens: int, block_size: int, *, eagle: bool) -> int:
    """``cached_tokens`` the engine reports when it holds ``held_pages`` leading pages of the prompt."""
    return block_size * min(held_pages, engine_reusable_pages(n_tokens, block_size, eagle=eagle))


def common_blocks(a: Sequence[int], b: Sequence[int], block_size: int, *, eagle: bool) -> int:
    """Leading blocks two prompts share: block k covers raw tokens ``[kB, kB+B]`` under EAGLE
    (B+1 tokens) and ``[kB, kB+B)`` with plain keys, so it is shared when those tokens are equal."""
    span = block_size + 1 if eagle else block_size
    k = 0
    while k * block_size + span <= min(len(a), len(b)) and \
            list(a[k * block_size:k * block_size + span]) == list(b[k * block_size:k * block_size + span]):
        k += 1
    return k


def overlaps(batches: Sequence[EventBatch], query: Sequence[int], block_size: int, lo: int, hi: int) -> list[int]:
    """Leading blocks of ``query`` (local hashes) held after the first j batches, for j in lo..hi."""
    idx, relay = PrefixIndex(), Relay(block_size)
    out = []
    for j in range(hi + 1):
        if j >= lo:
            out.append(idx.overlap(query).get(_WORKER, 0))
        if j < len(batches):
            for ev in batches[j].events:
                conv = relay.convert(ev)
                if conv is not None:
                    idx.apply(_WORKER, conv)
    return out


class WorkerViews:
    """One capture's batches per worker label, each from its epoch start."""

    def __init__(self, capture: EventCapture, block_size: int) -> None:
        self.capture, self.block_size = capture, block_size
        self.epoch: dict[str, int] = {}

    def batches(self, label: str) -> list[EventBatch]:
        return [c.batch for c in self.capture.snapshot() if c.label == label]

    def mark(self, label: str) -> int:
        """How many of ``label``'s batches have arrived (a position in its stream)."""
        return self.capture.count(label)

    def marks(self) -> dict[str, int]:
        return {label: self.mark(label) for label in self.capture.endpoints}

    def start_epoch(self, label: str) -> None:
        """Forget ``label``'s earlier batches: a new example after a flush, or a restarted worker."""
        self.epoch[label] = self.mark(label)

    def since_epoch(self, label: str) -> list[EventBatch]:
        return self.batches(label)[self.epoch.get(label, 0):]

    def held(self, label: str, tokens: Sequence[int], *, eagle: bool, lo: int, hi: int | None = None,
             namespace: str | None = None) -> list[int]:
        """Leading blocks of ``tokens`` (a tenant's, with ``namespace``) the view holds at each
        mark in ``[lo, hi]`` (absolute marks)."""
        start = self.epoch.get(label, 0)
        hi = lo if hi is None else hi
        return overlaps(self.since_epoch(label), query_hashes(tokens, self.block_size, eagle, namespace),
                        self.block_size, max(lo - start, 0), max(hi - start, 0))


def query_hashes(tokens: Sequence[int], block_size: int, eagle: bool, namespace: str | None) -> list[int]:
    """The prompt's blocks as an aligned router hashes them for its tenant."""
    return block_hashes(tokens, block_size, eagle=eagle, cache_namespace=namespace) if len(tokens) else []


class DeliveredViews:
    """The router's view: the engine's own batches, each counted once the hop delivered its
    sequence number to the router's side.

    Built from the engine's content rather than the hop's output, so a hop that *loses* a batch
    shows as a batch missing here, and a hop that *alters* one (a stripped ``cache_salt``) shows
    as the router disagreeing with this view. Marks are router-side marks.
    """

    def __init__(self, engine: WorkerViews, router: WorkerViews,
                 original: Callable[[str, int | None], int | None] = lambda _label, seq: seq) -> None:
        """``original``: a delivered batch's engine sequence number (a hop that renumbers maps it back)."""
        self.engine, self.router, self.original = engine, router, original

    def mark(self, label: str) -> int:
        return self.router.mark(label)

    def marks(self) -> dict[str, int]:
        return self.router.marks()

    def held(self, label: str, tokens: Sequence[int], *, eagle: bool, lo: int, hi: int | None = None,
             namespace: str | None = None) -> list[int]:
        start = self.router.epoch.get(label, 0)
        delivered, engine = self.router.since_epoch(label), self.engine.since_epoch(label)
        query = query_hashes(tokens, self.engine.block_size, eagle, namespace)
        out = []
        for j in range(max(lo - start, 0), max((lo if hi is None else hi) - start, 0) + 1):
            seqs = {self.original(label, b.seq) for b in delivered[:j]}
            kept = [b for b in engine if b.seq in seqs]
            out.append(overlaps(kept, query, self.engine.block_size, len(kept), len(kept))[0])
        return out
