"""The ``blocks`` rows of ``check --engine vllm``: vLLM's real ``KVCacheManager`` at 16, 32 and 64 tokens a block
behind a relay configured as ``dynamo.vllm`` configures it (vLLM's block size), each aligned; negative control: the
relay, card and router at another block size, which Dynamo's relay answers by dropping every one of vLLM's stores
(named ``BLOCK_SIZE`` from the events' own ``block_size``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from router_paths import open_router_path
from vllm_paths import open_vllm_worker

from kvalign.model.causes import Cause
from kvalign.oracles.vllm_router import VllmWorker
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.props.vllm.blocks import BLOCK_SIZES, blocks_body, misconfigured
from kvalign.verify.props.vllm.strategies import Served

#: a prefix stored, a shorter one asked, the whole again, another tail (hits of 0, 2 and 3 blocks)
SEQ = [Served((0, 1, 2), 3), Served((0, 1), 5), Served((0, 1, 2), 7), Served((2, 1), 0)]


@pytest.fixture(scope="module")
def path() -> Iterator[Any]:
    p = open_router_path("the relay -> KvRouter path for vLLM's events")
    yield p
    p.close()


@pytest.mark.parametrize("b", BLOCK_SIZES)
def test_vllm_is_credited_what_it_reuses_at_each_block_size(path, b):
    w = open_vllm_worker(path, b, 10)
    try:
        blocks_body(w)(SEQ)  # raises Mismatch where vLLM's hit and the router's credit differ
        assert w.ingest.block_size == b and len(w.dump()) >= 3  # the relay at vLLM's size indexed its blocks
    finally:
        w.close()


@pytest.mark.parametrize("b", BLOCK_SIZES)
def test_negative_control_a_relay_at_another_block_size_is_caught(path, b):
    w = open_vllm_worker(path, b, 10)
    try:
        misread = VllmWorker(w.engine, path.attach(w.hop, misconfigured(b)), w.hop)
        misread.barrier()
        with pytest.raises(Mismatch) as found:
            blocks_body(misread)(SEQ)
        assert found.value.cause is Cause.BLOCK_SIZE
        assert f"carry block_size [{b}], the relay's kv_block_size is {misconfigured(b)}" in found.value.detail
        assert misread.dump() == []  # the relay dropped every store: it indexed none of vLLM's blocks
    finally:
        w.close()
