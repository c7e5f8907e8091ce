"""vLLM's offload connector with chunks of several blocks behind the real relay and router: a candidate finding.

vllm#57159, the vLLM twin of kvalign's ``HOST_CREDIT_NOT_SERVABLE``: the connector publishes one
``BlockStored`` per chunk it stored in its CPU tier, naming every block of the chunk
(``OffloadingEventsTracker``), and Dynamo's relay indexes each of them in the host tier; the connector loads a
chunk only whole (looked up by its last block's hash), from the chunk holding the device hit. vLLM's real
``CPUOffloadingManager`` and tracker (:mod:`kvalign.oracles.vllm_offload`), a CPU tier of 4-block chunks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm_paths import vllm_on_router

from kvalign.model.causes import Cause
from kvalign.verify.props.vllm.strategies import Served, fresh_base
from kvalign.verify.props.vllm.tiers import Credit, credit, judge

B = 16
#: 4 blocks a chunk (64 tokens: a CPU tier configured with ``block_size`` 64 over 16-token device blocks)
CHUNK = 4


@pytest.fixture(scope="module")
def chunked() -> Iterator[Any]:
    with vllm_on_router(B, 10, offload={"blocks_per_chunk": CHUNK, "num_chunks": 8}) as w:
        yield w


def test_finding_the_connector_advertises_blocks_of_chunks_it_loads_only_whole(chunked):
    """vllm#57159: the connector publishes one ``BlockStored`` per chunk naming each of its blocks, and the
    relay indexes each in the host tier; it loads chunks only whole, from the chunk holding the device hit.
    Two ways the router credits host blocks vLLM recomputes: a prompt sharing 3 of a chunk's 4 blocks (the
    chunk's key is its last block), and a prompt whose device hit already covers 3 of the chunk's 4 blocks
    (less than a chunk left to load: ``_lookup_complete_chunks`` loads nothing)."""
    base = fresh_base()
    first = Served((0, 1, 2, 0), 1).tokens(base, B)
    chunked.engine.prefill(first)
    for chunks in ((1, 1, 1, 1), (2, 2, 2, 2)):  # evict the first prompt's device blocks; the CPU tier keeps it
        chunked.engine.prefill(Served(chunks, 1).tokens(base, B))
    chunked.sync()
    partial = first[: 3 * B] + [base + 998]
    assert credit(chunked, partial) == Credit(device=0, host=3, vllm_device=0, vllm_loaded=0)
    assert judge(credit(chunked, partial))[0] is Cause.HOST_CREDIT_NOT_SERVABLE


def test_finding_less_than_a_chunk_past_the_device_hit_is_credited_and_not_loaded(chunked):
    base = fresh_base()
    first = Served((0, 0, 0, 0), 1).tokens(base, B)
    chunked.engine.prefill(first)
    chunked.engine.prefill(Served((1, 0, 0, 0, 0), 1).tokens(base, B))  # evicts the first prompt's last block
    chunked.sync()
    assert credit(chunked, first) == Credit(device=3, host=1, vllm_device=3, vllm_loaded=3)
    assert judge(credit(chunked, first))[0] is Cause.HOST_CREDIT_NOT_SERVABLE
