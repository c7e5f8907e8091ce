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


#: vLLM's positional event encoding (``array_like`` structs, before vllm-project/vllm#42892; vLLM 0.23.0 sends it):
#: each event is ``[tag, field, ...]`` in this field order, trailing defaults omitted (``omit_defaults``).
POSITIONAL = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                              "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                              "kv_cache_spec_sliding_window"),
              "BlockRemoved": ("block_hashes", "medium", "group_idx"),
              "AllBlocksCleared": ()}


def as_map(event: Any) -> dict[str, Any]:
    """One of vLLM's events as a map with ``type``, whichever encoding it came in."""
    if isinstance(event, dict):
        return event
    tag, *values = event
    return {"type": tag, **dict(zip(POSITIONAL[tag], values))}


def encoded_as(event: dict[str, Any], length: int | None) -> Any:
    """``event`` (a map) back in its batch's encoding: as is for maps (``length`` None), else positional with
    ``length`` entries (the longest vLLM sent for its type); a field the control removed or renamed goes out
    as None, what a consumer reading that position then sees."""
    if length is None:
        return event
    return [event["type"], *(event.get(n) for n in POSITIONAL[event["type"]][:length - 1])]


def rewrite_events(fn: EventsFn) -> Callable[[list[bytes]], list[bytes] | None]:
    """A hop transform applying ``fn`` to each of vLLM's batches (events as maps with ``type``, whether vLLM
    sent named maps or positional arrays; sent on in the encoding they came in); a batch left empty is dropped.
    kvalign's barrier batches (one root block of sentinel tokens) pass untouched."""

    def transform(frames: list[bytes]) -> list[bytes] | None:
        batch = msgspec.msgpack.decode(frames[2])
        events = [as_map(e) for e in batch[1]]
        if len(events) == 1 and events[0].get("type") == "BlockStored" and (events[0].get("token_ids") or [0])[0] >= SENTINEL_BASE:
            return frames
        lengths: dict[str, int] = {}
        for e in batch[1]:
            if not isinstance(e, dict):
                lengths[e[0]] = max(lengths.get(e[0], 0), len(e))
        batch[1] = [encoded_as(e, lengths.get(e["type"])) for e in fn(events)]
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


def wire_encoding(worker: Any) -> str:
    """``map`` or ``positional``: the event encoding ``worker``'s vLLM publisher sends (seen on its hop while one
    barrier, published by vLLM's own publisher, passes)."""
    seen: list[str] = []

    def look(frames: list[bytes]) -> list[bytes]:
        events = msgspec.msgpack.decode(frames[2])[1]
        seen.extend("map" if isinstance(e, dict) else "positional" for e in events)
        return frames

    worker.hop.hop.transform = look
    try:
        worker.barrier()
    finally:
        worker.hop.hop.transform = None
    return seen[0]
