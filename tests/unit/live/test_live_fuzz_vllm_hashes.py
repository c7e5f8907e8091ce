"""Naming ``VLLM_BYTES_HASHES_DROPPED`` live (kvalign.live.runs.fuzz.vllm_hashes): the rule names it only from the
worker's environment, its stream's bytes-hash stores and a router index holding none of the worker's blocks; each
negative control removes one of those and the rule names nothing (the other rules then name the failure)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from kvalign.live.engines.vllm_cpu import INT_BLOCK_HASHES_ENV
from kvalign.live.runs.fuzz.options import FuzzEnvironmentError, FuzzOptions
from kvalign.live.runs.fuzz.rules import Rules
from kvalign.live.runs.fuzz.vllm_hashes import (BytesHashStores, bytes_hash_stores, bytes_hashes_cause,
                                                undecoded_payloads)
from kvalign.streams.capture import CaptureWriter

B = 32


def vllm_batch(hashes: list[object], *, parent: object = None) -> bytes:
    """One batch as vLLM 0.32's ZmqEventPublisher sends it: ``[ts, [events as named maps], dp_rank]``."""
    stored = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
              "token_ids": list(range(B * len(hashes))), "block_size": B, "lora_id": None, "medium": "GPU",
              "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0,
              "kv_cache_spec_kind": "full_attention"}
    return msgspec.msgpack.encode([1.0, [stored], 0])


BYTES = [bytes([i]) * 32 for i in (1, 2, 3)]  # vLLM's sha256 block hashes with the bytes setting
INTS = [11, 12, 13]  # the same blocks with vLLM's default int setting


def captured(tmp_path, payloads: list[bytes]) -> str:
    """The payloads through kvalign's real capture writer (what the fuzz's engine capture does with each batch)."""
    path = str(tmp_path / "worker0.capture.jsonl")
    writer = CaptureWriter(path, force=True)
    for seq, payload in enumerate(payloads):
        writer.write_frames([b"", seq.to_bytes(8, "big", signed=True), payload])
    writer.close()
    return path


def test_bytes_hash_batches_are_kept_undecoded_and_counted(tmp_path) -> None:
    """kvalign decodes hashes as Dynamo's relay does: a bytes-hash batch is kept undecoded with its payload, and
    counted; an int-hash batch decodes and is not."""
    path = captured(tmp_path, [vllm_batch(BYTES), vllm_batch(INTS), vllm_batch(BYTES[:1], parent=BYTES[2])])
    wire = bytes_hash_stores(undecoded_payloads(path))
    assert wire == BytesHashStores(batches=2, stores=2, blocks=4, widths=(32,))
    assert bytes_hash_stores(undecoded_payloads(captured(tmp_path, [vllm_batch(INTS)]))).stores == 0
    assert undecoded_payloads(tmp_path / "absent.jsonl") == [] and undecoded_payloads(None) == []


def test_positional_events_and_non_msgpack_payloads() -> None:
    positional = msgspec.msgpack.encode([1.0, [["BlockStored", BYTES[:2], None, list(range(2 * B)), B, None, "GPU"]], 0])
    assert bytes_hash_stores([positional, b"\xc1not msgpack"]) == BytesHashStores(1, 1, 2, (32,))


SEEN = dict(environ={INT_BLOCK_HASHES_ENV: "0", "PATH": "/bin"}, engine_tokens=96, credited=0, relay_pages=0,
            wire=BytesHashStores(batches=2, stores=2, blocks=4, widths=(32,)))


def test_named_when_the_worker_runs_bytes_hashes_reuses_and_the_router_holds_none_of_its_blocks() -> None:
    cause, evidence = bytes_hashes_cause(**SEEN)
    assert cause == "VLLM_BYTES_HASHES_DROPPED"
    assert evidence["setting"] == f"{INT_BLOCK_HASHES_ENV}=0" and evidence["engine_tokens"] == 96
    assert evidence["bytes_hash_stores"] == {"batches": 2, "stores": 2, "blocks": 4, "hash_bytes": [32]}
    assert "32-byte hashes" in evidence["detail"] and "credited 0 blocks" in evidence["detail"]


@pytest.mark.parametrize("change", [
    {"credited": 3},  # the router's index holds the worker's blocks for the prompt: not hidden by the encoding
    {"relay_pages": 3},  # a store of the worker's reached the relay decodable: its index is not empty
    {"environ": {"PATH": "/bin"}},  # vLLM's default: int hashes
    {"environ": {INT_BLOCK_HASHES_ENV: "1"}},
    {"environ": {INT_BLOCK_HASHES_ENV: "false"}},  # a value vLLM refuses to parse: no such worker runs
    {"environ": None},  # the worker's environment could not be read: never assumed
    {"engine_tokens": 0}, {"engine_tokens": None},  # vLLM reused nothing: no credit was lost
    {"wire": BytesHashStores()},  # no bytes-hash store on the worker's stream
])
def test_negative_controls_name_nothing(change: dict) -> None:
    assert bytes_hashes_cause(**{**SEEN, **change}) is None


def test_a_restart_step_sets_vllm_s_hash_encoding_on_vllm_workers_only() -> None:
    vllm = SimpleNamespace(opts=FuzzOptions(engine="vllm-cpu", page_size=32))
    assert Rules._engine_env(vllm, {"rule": "restart", "worker": 0, "vllm_block_hashes": "bytes"}) == {
        INT_BLOCK_HASHES_ENV: "0"}
    assert Rules._engine_env(vllm, {"rule": "restart", "worker": 0, "vllm_block_hashes": "int"}) == {
        INT_BLOCK_HASHES_ENV: "1"}
    assert Rules._engine_env(vllm, {"rule": "restart", "worker": 0}) is None
    with pytest.raises(FuzzEnvironmentError, match="int or bytes"):
        Rules._engine_env(vllm, {"rule": "restart", "worker": 0, "vllm_block_hashes": "hex"})
    with pytest.raises(FuzzEnvironmentError, match="needs --engine vllm-cpu"):
        Rules._engine_env(SimpleNamespace(opts=FuzzOptions()), {"rule": "restart", "worker": 0, "vllm_block_hashes": "bytes"})
