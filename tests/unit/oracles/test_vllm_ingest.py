"""ingest on vLLM: vLLM's real ``ZmqEventPublisher`` -> Dynamo's real relay -> a real ``KvRouter``.

Every block vLLM stores reaches the router's index as vLLM published it: under vLLM's own 64-bit hash,
chained to vLLM's parent, keyed by the router binding's own re-hash of the block's ``token_ids``, and
credited to a query for those tokens. Negative control: a hop that changes one token of each stored
block on its way to the relay; the router's keys then differ from the binding's hash of what vLLM
stored, and the comparison names the blocks.

Candidate finding, shown as it behaves: with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (vLLM then
publishes its block hashes as bytes) the relay indexes none of vLLM's blocks: overlap 0 while vLLM
reuses them, and nothing reaches the caller.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from router_paths import open_router_path
from vllm_paths import open_vllm_worker, rewrite_events

B = 16
PREFIX = list(range(1000, 1000 + 3 * B))


@pytest.fixture(scope="module")
def path() -> Iterator[Any]:
    p = open_router_path("the relay -> KvRouter path for vLLM's events")
    yield p
    p.close()


@pytest.fixture(scope="module")
def worker(path: Any) -> Iterator[Any]:
    w = open_vllm_worker(path, B, 64)
    yield w
    w.close()


def ingest_mismatches(worker: Any, events: list[dict[str, Any]]) -> list[str]:
    """Each way the router's index differs from vLLM's stored blocks, one line each."""
    from dynamo._core import compute_block_hash_for_seq

    indexed = {engine: (parent, local) for parent, engine, local in worker.dump()}
    out = []
    for ev in (e for e in events if e["type"] == "BlockStored"):
        keys = compute_block_hash_for_seq(ev["token_ids"], B)
        parent = ev["parent_block_hash"]
        for h, key in zip(ev["block_hashes"], keys):
            if h not in indexed:
                out.append(f"{h}: not indexed")
            elif indexed[h] != (parent, key):
                out.append(f"{h}: indexed as (parent, key) {indexed[h]}, vLLM stored ({parent}, {key})")
            parent = h
    return out


def test_vllm_blocks_are_indexed_as_vllm_published_them(worker):
    base = PREFIX + [7] * 5
    assert worker.engine.prefill(base) == 0
    events = worker.sync()
    assert worker.engine.prefill(PREFIX + list(range(5000, 5000 + B + 3))) == 3 * B
    events += worker.sync()
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert [len(e["block_hashes"]) for e in stored] == [3, 1] and stored[1]["parent_block_hash"] == stored[0]["block_hashes"][-1]
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for e in stored for h in e["block_hashes"])
    assert ingest_mismatches(worker, events) == []
    assert worker.overlap(PREFIX + list(range(5000, 5000 + B + 3))) == 4
    assert worker.overlap(list(range(1, 60))) == 0


def _shift_first_token(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for e in events:
        if e.get("type") == "BlockStored":
            e["token_ids"] = [e["token_ids"][0] + 1, *e["token_ids"][1:]]
    return events


def test_negative_control_a_hop_changing_tokens_is_caught(worker):
    worker.hop.hop.transform = rewrite_events(_shift_first_token)
    try:
        worker.engine.prefill(list(range(7000, 7000 + 2 * B)) + [1])
        events = worker.sync()
    finally:
        worker.hop.hop.transform = None
    stored = next(e for e in events if e["type"] == "BlockStored")
    found = ingest_mismatches(worker, events)
    assert len(found) == 1 and found[0].startswith(f"{stored['block_hashes'][0]}: indexed as")


@pytest.mark.slow  # a second vLLM child (another environment: bytes hashes), about 15 s; a finding shown, not a control
def test_finding_bytes_block_hashes_are_dropped_silently(path):
    """``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: vLLM stores and reuses the blocks, the router never
    indexes them (its barrier, an int-hashed block, still goes through: the relay is alive)."""
    w = open_vllm_worker(path, B, 64, env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"})
    try:
        assert not w.engine.int_hashes
        tokens = PREFIX + [7] * 5
        w.engine.prefill(tokens)
        events = w.sync()
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert stored and all(isinstance(h, bytes) and len(h) == 32 for h in stored[0]["block_hashes"])
        assert w.engine.match(tokens) == 3 * B  # vLLM would reuse 3 blocks
        assert w.overlap(tokens) == 0 and w.dump() == []  # the router credits none, indexes none
    finally:
        w.close()
