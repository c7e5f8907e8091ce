"""The ``hashes`` and ``events`` rows of ``check --engine vllm``: vLLM's int block hashes indexed by the router
(control: the same hashes re-encoded as 32 bytes on the hop, which the relay drops), vLLM's named-map events read
by name for every tenant (control: two fields renamed on the hop), and the bytes setting shown as the finding it is
(``VLLM_BYTES_HASHES_DROPPED``; a second vLLM interpreter, so ``slow``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from router_paths import open_router_path
from vllm_paths import open_vllm_worker, vllm_on_router

from kvalign.model.causes import Cause
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.props.vllm.bodies import tenants_body
from kvalign.verify.props.vllm.controls import on_hop
from kvalign.verify.props.vllm.encodings import (HASH_ENCODINGS, hashes_body, int_as_bytes, renamed_fields)
from kvalign.verify.props.vllm.strategies import Served

B = 16
#: every tenant, prefixes shared and evicted (10 blocks: one is vLLM's null block)
SEQ = [Served((0, 1, 2), 3, ("adapterA", "t1")), Served((0, 1), 5), Served((0, 1, 2), 2, (None, "t2")),
       Served((1, 1, 1, 1), 1, ("adapterB", None)), Served((0, 1, 2), 3, ("adapterA", "t1"))]


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    with vllm_on_router(B, 10) as w:
        yield w


def test_int_hashes_are_indexed_for_every_tenant(worker):
    hashes_body(worker)(SEQ)


def test_negative_control_int_hashes_sent_as_bytes_are_dropped(worker):
    with on_hop(worker, int_as_bytes), pytest.raises(Mismatch) as found:
        hashes_body(worker)([Served((0, 1, 2), 3)])
    assert found.value.cause is Cause.EVENTS_DROPPED
    assert found.value.detail.startswith("3 of the 3 blocks vLLM holds never indexed (vLLM's int hashes)")
    assert "vLLM reuses 48 tokens, the router credits 0 blocks" in found.value.detail


def test_named_map_events_credit_every_tenant(worker):
    tenants_body(worker)(SEQ)


def test_negative_control_renamed_map_fields_share_tenants_keys(worker):
    with on_hop(worker, renamed_fields), pytest.raises(Mismatch) as found:
        tenants_body(worker)([Served((0, 1, 2), 3, ("adapterA", "t1"))])
    assert found.value.cause is Cause.TENANTS_SHARE_KEYS


def test_the_controls_rewrite_only_what_they_name():
    ev = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": 7, "token_ids": [5], "lora_name": "a",
          "extra_keys": [("x",)]}
    as_bytes = int_as_bytes([dict(ev)])[0]
    assert as_bytes["block_hashes"] == [(1).to_bytes(32, "big"), (2).to_bytes(32, "big")]
    assert as_bytes["parent_block_hash"] == (7).to_bytes(32, "big") and as_bytes["token_ids"] == [5]
    assert renamed_fields([ev])[0] == {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": 7,
                                       "token_ids": [5], "lora": "a", "extra": [("x",)]}


@pytest.mark.slow  # a second vLLM interpreter (bytes hashes), about 15 s on a quiet machine: a finding, not a control
def test_finding_bytes_hashes_are_never_indexed():
    path = open_router_path("the relay -> KvRouter path for vLLM's events")
    try:
        w = open_vllm_worker(path, B, 10, env=HASH_ENCODINGS["bytes"])
        try:
            with pytest.raises(Mismatch) as found:
                hashes_body(w)([Served((0, 1, 2), 3)])
        finally:
            w.close()
    finally:
        path.close()
    assert found.value.cause is Cause.VLLM_BYTES_HASHES_DROPPED
    assert "(vLLM's 32-byte hashes)" in found.value.detail and "vLLM reuses 48 tokens, the router credits 0" in found.value.detail
