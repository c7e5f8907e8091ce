"""A version-independent model of SGLang KV events and a decoder for their ZMQ frames.

SGLang publishes ``[topic, seq (8 bytes, big-endian), msgpack payload]`` where the payload is a
batch ``[ts, events, attn_dp_rank]``. The events changed encoding between releases:

* 0.5.19: positional arrays ``["BlockStored", hashes, parent, token_ids, block_size, lora_id,
  medium(, {"cache_salt": ...})]`` (tag first);
* 0.5.23: tagged maps ``{"type": "BlockStored", ...}`` with None optionals omitted.

EAGLE events carry bigram pairs in ``token_ids``, which SGLang's own typed ``KVEventBatch``
rejects, so this decoder is untyped and normalises both encodings into the dataclasses below.
Every malformed input raises :class:`EventDecodeError` with a one-line reason.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

Encoding = Literal["positional", "map"]


class EventDecodeError(ValueError):
    """A frame or payload that is not a well-formed SGLang KV-event batch."""


@dataclass(frozen=True)
class BlockStored:
    """One radix node's newly cached pages: ``len(token_ids) == block_size * len(block_hashes)``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    session_id: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Pages evicted from the device cache (whole nodes, leaves first)."""

    block_hashes: list[int]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The engine dropped its whole cache (also sent once when a cache is constructed)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    """One published batch, with the frame metadata that makes gaps and restarts visible."""

    ts: float
    events: list[KVEvent]
    dp_rank: int | None
    encoding: Encoding
    seq: int | None = None
    topic: bytes = field(default=b"")


_decoder = msgspec.msgpack.Decoder()

# Error messages quote the offending value; frames are untrusted, so the quote is bounded in size
# and depth (a plain repr of a deeply nested value costs time and can overflow the stack).
_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxlist, _repr.maxdict, _repr.maxstring, _repr.maxother = 2, 4, 4, 40, 40
_repr.maxlong = 40


def _show(value: Any) -> str:
    return _repr.repr(value)

_STORED_POSITIONAL = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise EventDecodeError(f"{what} must be a list of integers, got {_show(value)}")
    return value


def _opt_int(value: Any, what: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise EventDecodeError(f"{what} must be an integer or nil, got {_show(value)}")
    return value


def _opt_str(value: Any, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise EventDecodeError(f"{what} must be a string or nil, got {_show(value)}")
    return value


def _token_ids(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise EventDecodeError(f"token_ids must be a list, got {_show(value)}")
    for t in value:
        if isinstance(t, list):
            if len(t) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in t):
                raise EventDecodeError(f"token_ids element is not an int or an int pair: {_show(t)}")
        elif not isinstance(t, int) or isinstance(t, bool):
            raise EventDecodeError(f"token_ids element is not an int or an int pair: {_show(t)}")
    if len({isinstance(t, list) for t in value}) > 1:  # SGLang sends all tokens or all bigrams, never both
        raise EventDecodeError(f"token_ids mixes ints and int pairs: {_show(value)}")
    return value


def _stored(fields: dict[str, Any]) -> BlockStored:
    hashes = _int_list(fields.get("block_hashes"), "BlockStored.block_hashes")
    bs = fields.get("block_size")
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        raise EventDecodeError(f"BlockStored.block_size must be a positive integer, got {_show(bs)}")
    tokens = _token_ids(fields.get("token_ids"))
    if len(tokens) != bs * len(hashes):
        raise EventDecodeError(
            f"BlockStored carries {len(tokens)} token units for {len(hashes)} blocks of size {bs}"
        )
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=_opt_int(fields.get("parent_block_hash"), "BlockStored.parent_block_hash"),
        token_ids=tokens,
        block_size=bs,
        lora_id=_opt_int(fields.get("lora_id"), "BlockStored.lora_id"),
        medium=_opt_str(fields.get("medium"), "BlockStored.medium"),
        cache_salt=_opt_str(fields.get("cache_salt"), "BlockStored.cache_salt"),
        lora_name=_opt_str(fields.get("lora_name"), "BlockStored.lora_name"),
        session_id=_opt_str(fields.get("session_id"), "BlockStored.session_id"),
    )


def _positional_event(raw: list[Any]) -> KVEvent:
    tag = raw[0] if raw else None
    if tag == "BlockStored":
        if len(raw) < 7:
            raise EventDecodeError(f"positional BlockStored has {len(raw)} elements, expected >= 7")
        fields = dict(zip(_STORED_POSITIONAL, raw[1:7]))
        if len(raw) > 7:
            extra = raw[7]
            if isinstance(extra, dict):  # BlockStoredWithMetadata (sglang >= 0.5.18)
                fields.update({k: v for k, v in extra.items() if k in ("cache_salt", "session_id", "lora_name")})
            elif isinstance(extra, str):  # Dynamo's positional lora_name extension
                fields["lora_name"] = extra
        return _stored(fields)
    if tag == "BlockRemoved":
        if len(raw) < 2:
            raise EventDecodeError("positional BlockRemoved has no block_hashes")
        return BlockRemoved(_int_list(raw[1], "BlockRemoved.block_hashes"),
                            _opt_str(raw[2] if len(raw) > 2 else None, "BlockRemoved.medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventDecodeError(f"unknown event type {_show(tag)}")


def _map_event(raw: dict[str, Any]) -> KVEvent:
    tag = raw.get("type")
    if tag == "BlockStored":
        return _stored(raw)
    if tag == "BlockRemoved":
        return BlockRemoved(_int_list(raw.get("block_hashes"), "BlockRemoved.block_hashes"),
                            _opt_str(raw.get("medium"), "BlockRemoved.medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventDecodeError(f"unknown event type {_show(tag)}")


def decode_payload(payload: bytes) -> EventBatch:
    """Decode one msgpack batch payload (either encoding) into an :class:`EventBatch`."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"payload is not valid msgpack ({exc})") from None
    except RecursionError:
        raise EventDecodeError("payload nests too deeply to be a KV-event batch") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise EventDecodeError("payload is not a [ts, events, dp_rank] batch")
    ts = raw[0]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise EventDecodeError(f"batch timestamp is not a number: {_show(ts)}")
    dp_rank = _opt_int(raw[2] if len(raw) > 2 else None, "batch dp_rank")
    events: list[KVEvent] = []
    encoding: Encoding | None = None
    for ev in raw[1]:
        if isinstance(ev, list):
            kind: Encoding = "positional"
            events.append(_positional_event(ev))
        elif isinstance(ev, dict):
            kind = "map"
            events.append(_map_event(ev))
        else:
            raise EventDecodeError(f"event is neither an array nor a map: {_show(ev)}")
        if encoding is not None and kind != encoding:
            raise EventDecodeError("batch mixes positional and map events")
        encoding = kind
    return EventBatch(float(ts), events, dp_rank, encoding or "positional")


def decode_frames(frames: list[bytes], *, expected_topic: bytes | None = None) -> EventBatch:
    """Decode one ZMQ multipart message ``[topic, seq, payload]`` as SGLang sends it."""
    if len(frames) != 3:
        raise EventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if expected_topic is not None and topic != expected_topic:
        raise EventDecodeError(f"frame topic {_show(topic)} is not the expected {_show(expected_topic)}")
    if len(seq) != 8:
        raise EventDecodeError(f"sequence frame has {len(seq)} bytes, expected 8")
    batch = decode_payload(payload)
    return EventBatch(batch.ts, batch.events, batch.dp_rank, batch.encoding, int.from_bytes(seq, "big", signed=True), topic)
