"""kvalign's model of the keys Dynamo's relay gives vLLM's blocks (the differential check against the real
relay is tests/unit/oracles/test_vllm_hash.py); here the rules themselves, each with the case it decides."""

from __future__ import annotations

import pytest

from kvalign.model.hashing import compute_block_hash_for_seq
from kvalign.model.vllm_keys import VllmRelayModel, block_mm_infos, dynamo_mm_identifier, dynamo_salt, relay_salt

B = 4


def stored(hashes, tokens, parent=None, extra=None, lora=None):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": B, "lora_name": lora, "extra_keys": extra}


def test_relay_salt_needs_dynamos_prefix_and_strips_it():
    assert relay_salt(stored([1], [0] * B, extra=[[dynamo_salt("t")]])) == "t"
    assert relay_salt(stored([1], [0] * B, extra=[["t"]])) is None  # vLLM's own salt: not the router's
    assert relay_salt(stored([1, 2], [0] * 2 * B, extra=[["loraA", dynamo_salt("t")], ["loraA"]], lora="loraA")) == "t"
    assert relay_salt(stored([1], [0] * B, extra=None)) is None


def test_model_keys_each_block_by_its_tokens_tenant_and_inherited_namespace():
    model = VllmRelayModel(B)
    model.apply(stored([10, 11], list(range(8)), extra=[[dynamo_salt("t")], None], lora="a"))
    model.apply(stored([12], list(range(8, 12)), parent=11))  # no salt of its own: its parent's namespace
    assert [model.keys[h] for h in (10, 11)] == compute_block_hash_for_seq(list(range(8)), B, lora_name="a",
                                                                           cache_namespace="t")
    assert model.keys[12] == compute_block_hash_for_seq(list(range(8, 12)), B, cache_namespace="t")[0]
    model.apply({"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"})
    assert set(model.keys) == {10, 12}
    model.apply({"type": "AllBlocksCleared"})
    assert model.keys == {}


def test_an_unknown_event_is_an_error_naming_it():
    with pytest.raises(ValueError, match="'BlockMoved'"):
        VllmRelayModel(B).apply({"type": "BlockMoved"})


def test_dynamo_mm_identifier_is_the_hash_in_16_hex_digits_then_48_zeros():
    assert dynamo_mm_identifier(0x0123_4567_89AB_CDEF) == "0123456789abcdef" + "0" * 48
    assert dynamo_mm_identifier(5) == "0000000000000005" + "0" * 48


def test_block_mm_infos_put_an_image_on_every_full_block_its_placeholders_touch():
    # 4 full blocks of 4 tokens and a partial one; the image covers tokens 3..9: blocks 0, 1 and 2
    infos = block_mm_infos(18, 4, [(7, 3, 7)])
    assert infos == [{"mm_objects": [{"mm_hash": 7, "offsets": []}]}] * 3 + [None]
    two = block_mm_infos(8, 4, [(9, 6, 2), (7, 1, 2)])  # sorted by offset, one per block
    assert two == [{"mm_objects": [{"mm_hash": 7, "offsets": []}]}, {"mm_objects": [{"mm_hash": 9, "offsets": []}]}]
    assert block_mm_infos(8, 4, []) is None
