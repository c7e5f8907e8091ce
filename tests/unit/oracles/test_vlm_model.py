"""The tiny Qwen2-VL directory both sides read: its tokenizer must round-trip, its configs name Qwen2-VL."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvalign.oracles import vlm_model as vm

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok():
    return vm.build_tokenizer()


def test_special_tokens_and_words_have_their_ids(tok):
    v = vm.vocab()
    assert v[vm.LEADING_WORD] == 0 and len(v) == len(set(v.values())) <= vm.VOCAB_SIZE
    ids = tok.encode("<|im_start|>user describe this image<|vision_start|><|image_pad|><|vision_end|>").ids
    assert ids == [v["<|im_start|>"], v["user"], v["\u0120describe"], v["\u0120this"], v["\u0120image"],
                   v["<|vision_start|>"], v["<|image_pad|>"], v["<|vision_end|>"]]


PART = st.one_of(st.sampled_from(vm.SPECIAL[:6]), st.builds(lambda ws: " ".join(ws), st.lists(st.sampled_from(vm.WORDS), min_size=1, max_size=4)))


@given(st.lists(PART, min_size=1, max_size=8))
def test_decode_then_encode_gives_the_same_ids(parts):
    """SGLang's processor decodes a token-id prompt and re-encodes it: the ids must survive."""
    tok = vm.build_tokenizer()
    ids = tok.encode("".join(parts)).ids
    assert tok.encode(tok.decode(ids, skip_special_tokens=False)).ids == ids


def test_directory_names_qwen2_vl_for_both_sides(tmp_path):
    root = vm.write_vlm_dir(tmp_path / "m")
    config = json.loads((root / "config.json").read_text())
    assert config["model_type"] == "qwen2_vl" and config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert config["image_token_id"] == vm.token_id("<|image_pad|>")
    assert sum(config["rope_scaling"]["mrope_section"]) == vm.HEAD_DIM // 2
    pre = json.loads((root / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "Qwen2VLImageProcessor" and pre["max_pixels"] == vm.MAX_PIXELS
    assert "<|vision_start|><|image_pad|><|vision_end|>" in json.loads((root / "tokenizer_config.json").read_text())["chat_template"]
