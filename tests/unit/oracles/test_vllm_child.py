"""The vLLM child's event conversion: fields by name whatever the release's struct encoding."""

from __future__ import annotations

import msgspec

from kvalign.oracles.vllm_child import event_dict


class Positional(msgspec.Struct, array_like=True, tag=True):  # vllm 0.23.0's events: array_like
    block_hashes: list[int]
    token_ids: list[int]
    lora_name: str | None


class Named(msgspec.Struct, tag=True):  # vllm 0.28.0 on: named maps
    block_hashes: list[bytes]
    lora_name: str | None


def test_events_become_maps_by_field_name_in_either_encoding():
    assert msgspec.to_builtins(Positional([1], [2, 3], None))[0] == "Positional"  # the control: a list, tag first
    assert event_dict(Positional([1], [2, 3], "a")) == {"block_hashes": [1], "token_ids": [2, 3], "lora_name": "a",
                                                        "type": "Positional"}
    assert event_dict(Named([b"\x01"], None)) == {"block_hashes": [b"\x01"], "lora_name": None, "type": "Named"}
