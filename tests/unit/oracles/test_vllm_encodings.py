"""Which event encodings Dynamo 1.6.1's relay reads from vLLM: the named maps vLLM 0.32 publishes (its only form:
``KVCacheEvent`` is ``tag=True`` without ``array_like``) and the positional arrays vLLM published before
vllm-project/vllm#42892, both with LoRA and ``cache_salt`` tenants. The map form is the ``events`` row of
``check --engine vllm`` (with its control); this shows the positional form is not a second row the release could
need: the relay keys it the same, element 7 as ``lora_name`` and element 8 as ``extra_keys``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from vllm_paths import vllm_on_router

from kvalign.model.vllm_keys import dynamo_salt
from kvalign.oracles.router_path import SENTINEL_BASE

B = 16
#: vLLM's BlockStored fields up to extra_keys, in declaration order (vllm/distributed/kv_events.py)
STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys")
_ranges = itertools.count(1)


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    with vllm_on_router(B, 32) as w:
        yield w


def positional(frames: list[bytes]) -> list[bytes]:
    """vLLM's batch with each event as the positional array ``array_like=True`` would send (barriers untouched)."""
    batch = msgspec.msgpack.decode(frames[2])
    events = batch[1]
    if len(events) == 1 and events[0].get("type") == "BlockStored" and events[0]["token_ids"][0] >= SENTINEL_BASE:
        return frames
    batch[1] = [[e["type"], *(e.get(f) for f in (STORED if e["type"] == "BlockStored" else ("block_hashes", "medium")))]
                for e in events]
    return [frames[0], frames[1], msgspec.msgpack.encode(batch)]


@pytest.mark.parametrize("encoding", ["map", "positional"])
@pytest.mark.parametrize("tenant", [(None, None), ("adapterA", None), (None, "t1"), ("adapterA", "t1")])
def test_the_relay_keys_both_encodings_for_every_tenant(worker, encoding, tenant):
    lora, ns = tenant
    base = next(_ranges) * 1000 + (1 << 24)
    tokens = list(range(base, base + 3 * B)) + [base + 999] * 5
    worker.hop.hop.transform = positional if encoding == "positional" else None
    try:
        worker.engine.prefill(tokens, lora_name=lora, cache_salt=dynamo_salt(ns) if ns else None)
        worker.sync()
    finally:
        worker.hop.hop.transform = None
    assert worker.overlap(tokens, lora_name=lora, cache_namespace=ns) == 3
    assert worker.overlap(tokens) == (3 if tenant == (None, None) else 0)  # a tenant's blocks are its own
