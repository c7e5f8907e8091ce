"""The negative controls of ``check --engine vllm``: each breaks exactly what its row guards, on the hop
between vLLM's publisher and the relay or in kvalign's model, and its row must then fail with the
expected cause (a row whose control passes proves nothing: ``check`` exits 2)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from kvalign.oracles.router_path import SENTINEL_BASE

#: a negative control's example budget (a control must fail within it)
CONTROL_EXAMPLES = 25

EventsFn = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def rewrite_events(fn: EventsFn) -> Callable[[list[bytes]], list[bytes] | None]:
    """A hop transform applying ``fn`` to each of vLLM's batches (events as maps with ``type``); a batch
    left empty is dropped. kvalign's barrier batches (one root block of sentinel tokens) pass untouched."""

    def transform(frames: list[bytes]) -> list[bytes] | None:
        batch = msgspec.msgpack.decode(frames[2])
        events = batch[1]
        if len(events) == 1 and events[0].get("type") == "BlockStored" and (events[0].get("token_ids") or [0])[0] >= SENTINEL_BASE:
            return frames
        batch[1] = fn(events)
        return [frames[0], frames[1], msgspec.msgpack.encode(batch)] if batch[1] else None

    return transform


def drop_removed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A relay that misses evictions."""
    return [e for e in events if e.get("type") != "BlockRemoved"]


def drop_stored(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A relay that drops vLLM's stores."""
    return [e for e in events if e.get("type") != "BlockStored"]


def tenant_blind(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A relay that reads neither ``extra_keys`` nor ``lora_name``: every tenant's blocks keyed as the base model's."""
    for e in events:
        if e.get("type") == "BlockStored":
            e.pop("extra_keys", None)
            e["lora_name"] = e["lora_id"] = None
    return events


@contextmanager
def on_hop(worker: Any, fn: EventsFn) -> Iterator[None]:
    """``fn`` applied on ``worker``'s hop for the duration (the router's index keeps what it did)."""
    worker.hop.hop.transform = rewrite_events(fn)
    try:
        yield
    finally:
        worker.hop.hop.transform = None
