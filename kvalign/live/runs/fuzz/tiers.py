"""kvalign's views of a live worker's two KV tiers (device, host) with HiCache on, from its KV events.

SGLang's HiCache publishes each page's tier in its events: a page written to the device is
``BlockStored(medium="GPU")``, its host copy ``BlockStored(medium="CPU_PINNED")``; a device
eviction is ``BlockRemoved(medium="GPU")`` (the page stays on host), a host eviction
``BlockRemoved(medium="CPU_PINNED")``. Dynamo's relay files them the same way
(:data:`kvalign.model.relay.RELAY_TIERS`). A prompt's residency is then what both sides compute:

* ``device``: its leading pages held on the device (SGLang's ``match_prefix`` device prefix, the
  router's ``device_blocks``);
* ``host``: the pages right after them held on host only (SGLang's ``host_hit_length`` in pages, the
  router's ``host_pinned_extension_blocks``).

:class:`TierWorkerViews` / :class:`TierDeliveredViews` are the fuzz's engine and router views with
tiers: ``held`` counts the leading pages held in *either* tier (what the router credits in all,
what the engine holds somewhere), ``residency`` splits them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvalign.model.hashing import U64_MASK
from kvalign.model.relay import RELAY_TIERS, Relay
from kvalign.live.runs.fuzz.views import DeliveredViews, WorkerViews, query_hashes

DEVICE, HOST = "device", "host_pinned"


@dataclass(frozen=True)
class Residency:
    """A prompt's leading pages: ``device`` on the device, then ``host`` more on host only."""

    device: int = 0
    host: int = 0

    @property
    def held(self) -> int:
        return self.device + self.host


@dataclass(eq=False)
class _Node:
    children: dict[int, "_Node"] = field(default_factory=dict)
    tiers: set[str] = field(default_factory=set)


class TierIndex:
    """One worker's pages by tier, keyed as the router keys them (local hashes under their parents)."""

    def __init__(self, block_size: int) -> None:
        self.relay = Relay(block_size)
        self.root = _Node()
        self.by_hash: dict[int, _Node] = {}

    def apply(self, event: object) -> None:
        if isinstance(event, AllBlocksCleared):
            self.relay.convert(event)
            for node in self.by_hash.values():
                node.tiers.clear()
            self.by_hash.clear()
            return
        tier = RELAY_TIERS.get(getattr(event, "medium", None))
        if isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                node = self.by_hash.get(h & U64_MASK)
                if node is not None:
                    node.tiers.discard(tier)
                    if not node.tiers:
                        del self.by_hash[h & U64_MASK]
            return
        if not isinstance(event, BlockStored) or tier not in (DEVICE, HOST):
            return  # a tier the router indexes nowhere counts nowhere here either
        stored = self.relay.convert(event)
        if stored is None:
            return
        parent = self.root if stored.parent_hash is None else self.by_hash.get(stored.parent_hash)
        if parent is None:
            return  # an orphan, as the router drops it
        for ext, local in stored.blocks:
            child = parent.children.setdefault(local, _Node())
            child.tiers.add(tier)
            self.by_hash[ext] = child
            parent = child

    def residency(self, local_hashes: Sequence[int]) -> Residency:
        device = host = 0
        node = self.root
        for h in local_hashes:
            node = node.children.get(h)
            if node is None:
                break
            if host == 0 and DEVICE in node.tiers:
                device += 1
            elif HOST in node.tiers:
                host += 1
            else:
                break
        return Residency(device, host)


def residencies(batches: Sequence[EventBatch], query: Sequence[int], block_size: int, lo: int, hi: int) -> list[Residency]:
    """The query's residency after the first j batches, for j in lo..hi."""
    idx, out = TierIndex(block_size), []
    for j in range(hi + 1):
        if j >= lo:
            out.append(idx.residency(query))
        if j < len(batches):
            for ev in batches[j].events:
                idx.apply(ev)
    return out


class TierWorkerViews(WorkerViews):
    """:class:`WorkerViews` with tiers: ``held`` is the pages held in either tier."""

    def residency(self, label: str, tokens: Sequence[int], *, eagle: bool, lo: int, hi: int | None = None,
                  namespace: str | None = None) -> list[Residency]:
        start = self.epoch.get(label, 0)
        hi = lo if hi is None else hi
        return residencies(self.since_epoch(label), query_hashes(tokens, self.block_size, eagle, namespace),
                           self.block_size, max(lo - start, 0), max(hi - start, 0))

    def held(self, label: str, tokens: Sequence[int], *, eagle: bool, lo: int, hi: int | None = None,
             namespace: str | None = None) -> list[int]:
        return [r.held for r in self.residency(label, tokens, eagle=eagle, lo=lo, hi=hi, namespace=namespace)]


class TierDeliveredViews(DeliveredViews):
    """:class:`DeliveredViews` with tiers: the engine's batches the hop delivered, by tier."""

    def residency(self, label: str, tokens: Sequence[int], *, eagle: bool, lo: int, hi: int | None = None,
                  namespace: str | None = None) -> list[Residency]:
        start = self.router.epoch.get(label, 0)
        delivered, engine = self.router.since_epoch(label), self.engine.since_epoch(label)
        query = query_hashes(tokens, self.engine.block_size, eagle, namespace)
        out = []
        for j in range(max(lo - start, 0), max((lo if hi is None else hi) - start, 0) + 1):
            seqs = {self.original(label, b.seq) for b in delivered[:j]}
            kept = [b for b in engine if b.seq in seqs]
            out.append(residencies(kept, query, self.engine.block_size, len(kept), len(kept))[0])
        return out

    def held(self, label: str, tokens: Sequence[int], *, eagle: bool, lo: int, hi: int | None = None,
             namespace: str | None = None) -> list[int]:
        return [r.held for r in self.residency(label, tokens, eagle=eagle, lo=lo, hi=hi, namespace=namespace)]
