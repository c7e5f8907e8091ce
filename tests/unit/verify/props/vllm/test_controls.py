"""The negative controls' hop rewrite on both of vLLM's event encodings: named maps (vLLM >= 0.26) and the
positional arrays vLLM 0.23.0 still sends (``array_like`` structs, trailing defaults omitted). A control that
crashed on arrays made every 0.23.0 pair an error row; one that rewrote them wrongly would prove nothing."""

from __future__ import annotations

import msgspec

from kvalign.oracles.router_path import SENTINEL_BASE
from kvalign.verify.props.vllm import controls


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(_Event):  # vLLM 0.23.0's field order (vllm/distributed/kv_events.py)
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


def _frames(events: list) -> list[bytes]:
    return [b"topic", b"\x00" * 8, msgspec.msgpack.encode([1.0, events, None])]


def _events(frames: list[bytes] | None) -> list:
    assert frames is not None
    return msgspec.msgpack.decode(frames[2])[1]


STORED = BlockStored([11, 12], None, list(range(4)), 2, 1, "GPU", "adapterA", [("adapterA", "dynamo-cache-salt:t1"), None])
REMOVED = BlockRemoved([11], "GPU")


def test_positional_events_are_read_by_name_and_sent_on_positional():
    out = _events(controls.rewrite_events(controls.tenant_blind)(_frames([STORED, REMOVED])))
    sent = msgspec.msgpack.decode(msgspec.msgpack.encode([STORED, REMOVED]))
    assert len(out[0]) == len(sent[0]) and len(out[1]) == len(sent[1])  # every position vLLM sent, no more
    assert out[0][:9] == ["BlockStored", [11, 12], None, [0, 1, 2, 3], 2, None, "GPU", None, None]
    assert out[1] == sent[1]
    # the relay's own decoder reads the rewritten arrays back as vLLM's structs
    assert msgspec.convert(out[0], BlockStored).lora_name is None


def test_filters_keep_the_other_events_in_their_encoding():
    kept = _events(controls.rewrite_events(controls.drop_removed)(_frames([STORED, REMOVED])))
    assert kept == [msgspec.msgpack.decode(msgspec.msgpack.encode(STORED))]
    assert controls.rewrite_events(controls.drop_stored)(_frames([STORED])) is None


def test_named_maps_are_rewritten_as_maps():
    named = {"type": "BlockStored", "block_hashes": [11], "parent_block_hash": None, "token_ids": [0, 1],
             "block_size": 2, "lora_id": 1, "medium": "GPU", "lora_name": "adapterA", "extra_keys": [("adapterA",)]}
    out = _events(controls.rewrite_events(controls.tenant_blind)(_frames([named])))
    assert out == [{**{k: v for k, v in named.items() if k != "extra_keys"}, "lora_id": None, "lora_name": None}]


def test_a_barrier_passes_untouched_in_either_encoding():
    sentinel = BlockStored([1], None, [SENTINEL_BASE + 1] * 2, 2, None, "GPU", None)
    frames = _frames([sentinel])
    assert controls.rewrite_events(controls.drop_stored)(frames) is frames
