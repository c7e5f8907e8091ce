"""Naming ``VLLM_BYTES_HASHES_DROPPED`` on a live vLLM worker, from what the run saw, not from the setting alone.

With ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` vLLM publishes each block's 32-byte hash
(``kv_cache_utils.maybe_convert_block_hash``), which Dynamo 1.6.1's relay cannot decode into its u64 hashes: it
drops every such batch and logs nothing at its default level, so the router indexes none of the worker's blocks
while vLLM reuses them. kvalign's own decoder reads block hashes as Dynamo does, so its views of that worker are
empty too, and without this rule the failure would be named from an empty stream (``ENGINE_EVENTS_MISSING``:
the engine reused pages its events never stored), which points at the engine's publisher instead of the
encoding the relay cannot read.

The cause is named only where all of these were seen on the failing request's worker:

* its process runs with the bytes setting (read from the kernel's copy of its environment, parsed as vLLM does);
* vLLM reused tokens of the prompt and the router credited none of them on that worker;
* the worker's own stream carried ``BlockStored`` events whose hashes are bytes (the batches kvalign's capture
  kept undecoded, with their payload), and not one store of the worker's reached the relay in a form it reads
  (kvalign's router-side view holds no page of the worker's since its epoch).

An index that holds any of the worker's blocks (a credit, or a decodable store at the relay) is not this cause:
the encoding did not hide the worker from the router, and the failure is named by the other rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvalign.live.engines.vllm_cpu import INT_BLOCK_HASHES_ENV, hash_encoding
from kvalign.model.causes import Cause
from kvalign.streams.capture import CaptureReader

_msgpack = msgspec.msgpack.Decoder()


@dataclass(frozen=True)
class BytesHashStores:
    """The ``BlockStored`` events with bytes hashes in one worker's undecoded batches."""

    batches: int = 0  # undecoded batches holding at least one such store
    stores: int = 0
    blocks: int = 0
    widths: tuple[int, ...] = ()  # the hashes' byte lengths seen (vLLM: 32)

    def as_json(self) -> dict[str, Any]:
        return {"batches": self.batches, "stores": self.stores, "blocks": self.blocks, "hash_bytes": list(self.widths)}


def _stored_hashes(event: Any) -> list[Any] | None:
    """A raw event's block hashes when it is a ``BlockStored`` (named map or positional array), else None."""
    if isinstance(event, dict) and event.get("type") == "BlockStored":
        hashes = event.get("block_hashes")
    elif isinstance(event, list) and event and event[0] == "BlockStored" and len(event) > 1:
        hashes = event[1]
    else:
        return None
    return hashes if isinstance(hashes, list) else None


def bytes_hash_stores(payloads: list[bytes]) -> BytesHashStores:
    """Count the bytes-hash stores in raw batch payloads (``[ts, events, dp_rank]`` msgpack); a payload that is not
    msgpack is skipped (it says nothing about hashes)."""
    batches = stores = blocks = 0
    widths: set[int] = set()
    for payload in payloads:
        try:
            raw = _msgpack.decode(payload)
        except msgspec.DecodeError:
            continue
        events = raw[1] if isinstance(raw, list) and len(raw) > 1 and isinstance(raw[1], list) else []
        found = [hs for hs in map(_stored_hashes, events) if hs and all(isinstance(h, bytes) for h in hs)]
        batches += bool(found)
        stores += len(found)
        blocks += sum(len(hs) for hs in found)
        widths.update(len(h) for hs in found for h in hs)
    return BytesHashStores(batches, stores, blocks, tuple(sorted(widths)))


def undecoded_payloads(capture_path: str | Path | None) -> list[bytes]:
    """The payloads of the batches a kvalign capture file kept undecoded ([] without a file)."""
    if capture_path is None or not Path(capture_path).exists() or not Path(capture_path).stat().st_size:
        return []
    with CaptureReader(str(capture_path)) as reader:
        return [line.raw for line in reader.batches() if line.bad is not None and line.raw]


def bytes_hashes_cause(*, environ: Mapping[str, str] | None, engine_tokens: int | None, credited: int | None,
                       relay_pages: int, wire: BytesHashStores) -> tuple[str, dict[str, Any]] | None:
    """``VLLM_BYTES_HASHES_DROPPED`` with its evidence when every condition of the module docstring holds, else None.

    ``environ``: the worker process's environment (None: it could not be read); ``engine_tokens``: what vLLM reused
    of the prompt; ``credited``: the router's credit on that worker, in blocks; ``relay_pages``: pages of the
    worker's decodable stores that reached the relay since its epoch; ``wire``: the bytes-hash stores on the
    worker's own stream."""
    if environ is None or not engine_tokens or credited != 0 or relay_pages or not wire.stores:
        return None
    try:
        if hash_encoding(environ) != "bytes":
            return None
    except ValueError:  # a value vLLM itself refuses: not a setting this worker runs with
        return None
    setting = f"{INT_BLOCK_HASHES_ENV}={environ[INT_BLOCK_HASHES_ENV]}"
    detail = (f"the worker runs with {setting} (its process environment); vLLM reused {engine_tokens} tokens and the "
              f"router credited 0 blocks; the worker's stream carried {wire.stores} BlockStored event(s) "
              f"({wire.blocks} blocks) with {'/'.join(map(str, wire.widths))}-byte hashes and no store the relay can "
              "decode: Dynamo's relay dropped every one, its index holds none of the worker's blocks")
    return Cause.VLLM_BYTES_HASHES_DROPPED.name, {
        "detail": detail, "setting": setting, "engine_tokens": engine_tokens, "router_blocks": credited,
        "relay_pages": relay_pages, "bytes_hash_stores": wire.as_json()}
