"""Worker-side conversion of SGLang KV events into router events, as Dynamo's relay does it.

Dynamo never matches SGLang's own block hashes: its ZMQ relay rebuilds each page's raw token
window from the event and re-hashes it with the router hasher, keeping the engine hash only as
an opaque node id. The rules mirrored here (ai-dynamo-runtime 1.6.1, ``zmq_wire``/``convert.rs``):

* EAGLE is decided **per event** from the payload shape (pairs), never from configuration;
* pairs flatten to all firsts + the last second, and page i hashes ``raw[iB : iB + B + eagle]``;
* a page whose ``block_size`` differs from the router's ``kv_block_size`` is dropped with every
  page after it in the event, and so is a page whose window is short;
* an event without ``cache_salt`` inherits its parent's namespace;
* a hash repeated inside an event, or equal to its parent, drops the whole event;
* signed int64 engine hashes are reinterpreted as u64.

The hasher is a parameter so a misaligned router build is exercised on this side too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvalign.model.hashing import U64_MASK, compute_block_hash_for_seq
from kvalign.model.sglang_keys import is_bigram_payload, raw_window


#: Dynamo 1.6.1's relay: SGLang ``medium`` string -> the router's storage tier (tests/unit/verify/props/tier/test_check_tier.py
#: checks it against the real relay). Any other string is indexed in no tier, with no error.
#: (The tier names are the router's ``dump_events`` ``storage_tier``; ``get_overlap_scores`` credits
#: ``external`` blocks in ``disk_extension_blocks``.)
RELAY_TIERS: dict[str | None, str] = {None: "device", "GPU": "device", "CPU_PINNED": "host_pinned", "CPU": "host_pinned",
                                      "DISK": "disk", "EXTERNAL": "external"}


@dataclass(frozen=True)
class RouterStored:
    """Blocks as the router indexes them: (engine hash as u64, router local hash)."""

    parent_hash: int | None
    blocks: list[tuple[int, int]]


@dataclass(frozen=True)
class RouterRemoved:
    block_hashes: list[int]


@dataclass(frozen=True)
class RouterCleared:
    pass


RouterEvent = RouterStored | RouterRemoved | RouterCleared


@dataclass
class RelayStats:
    """What the relay dropped, and why: each is a way the index silently diverges."""

    dropped_block_size: int = 0
    dropped_short_window: int = 0
    dropped_duplicate_events: int = 0


class Relay:
    """Converts one worker's engine events to router events with a given router hasher."""

    def __init__(self, kv_block_size: int, hasher: Callable[..., list[int]] = compute_block_hash_for_seq):
        if kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {kv_block_size}")
        self.kv_block_size = kv_block_size
        self.hasher = hasher
        self.stats = RelayStats()
        self._namespace: dict[int, str | None] = {}

    def convert(self, event: KVEvent) -> RouterEvent | None:
        """The router event for one engine event, or ``None`` when Dynamo would drop it."""
        if isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._namespace.pop(h & U64_MASK, None)
            return RouterRemoved([h & U64_MASK for h in event.block_hashes])
        if isinstance(event, AllBlocksCleared):
            self._namespace.clear()
            return RouterCleared()
        return self._stored(event)

    def _stored(self, ev: BlockStored) -> RouterStored | None:
        parent = None if ev.parent_block_hash is None else ev.parent_block_hash & U64_MASK
        ext = [h & U64_MASK for h in ev.block_hashes]
        if len(set(ext)) != len(ext) or (parent is not None and parent in ext):
            self.stats.dropped_duplicate_events += 1
            return None
        namespace = ev.cache_salt or (self._namespace.get(parent) if parent is not None else None)
        eagle = is_bigram_payload(ev.token_ids)
        raw = raw_window(ev.token_ids, strict=False) if ev.token_ids else []
        b = self.kv_block_size
        win = b + 1 if eagle else b
        blocks: list[tuple[int, int]] = []
        for i, h in enumerate(ext):
            if ev.block_size != b:
                self.stats.dropped_block_size += len(ext) - i
                break
            window = raw[i * b : i * b + win]
            local = self.hasher(window, b, None, ev.lora_name, eagle, namespace) if len(window) == win else []
            if not local:
                self.stats.dropped_short_window += len(ext) - i
                break
            blocks.append((h, int(local[0])))
            self._namespace[h] = namespace
        return RouterStored(parent, blocks)
