"""Dynamo's real frontend preprocessing image requests: what its router is handed.

The first test reads a PreprocessedRequest's fields; the others run the real ``dynamo.frontend``
(``mm_oracles``), so they are ``slow``.
"""

from __future__ import annotations

import pytest

from kvalign.oracles.frontend_mm import chat_content, parse_preprocessed
from kvalign.model.mm_keys import pad_runs
from kvalign.standins.sglang_scalar_pads import scalar_pad_value
from kvalign.verify.props.mm.strategies import Image


def test_fields_of_a_preprocessed_request():
    request = {"token_ids": [1, 6, 2], "extra_args": {"mm_hashes": ["00000000000000ff"]},
               "mm_routing_info": {"routing_token_ids": [1, 7, 7, 2, 0], "block_mm_infos": [], "expanded_prompt_len": 4}}
    pre = parse_preprocessed(4, request)
    assert pre.router_tokens == [1, 7, 7, 2, 0] and pre.mm_hashes == ["00000000000000ff"] and pre.expanded_prompt_len == 4
    bare = parse_preprocessed(4, {"token_ids": [1, 6, 2]})
    assert bare.routing_token_ids is None and bare.router_tokens == [1, 6, 2] and bare.mm_hashes is None
    assert chat_content([("text", "a b"), ("image", "data:x")]) == [
        {"type": "text", "text": "a b"}, {"type": "image_url", "image_url": {"url": "data:x"}}]
    with pytest.raises(ValueError):
        chat_content([("audio", "x")])


@pytest.mark.slow
def test_frontend_fills_each_image_with_its_hashs_scalar_pad_value(mm_oracles):
    """The frontend's pad value is ``1_000_000 + hash % 2**30``: SGLang 0.5.21's rule (the stand-in's)."""
    frontend, _ = mm_oracles
    images = [Image(56, 56, 1), Image(100, 60, 2), Image(56, 56, 1)]
    pre = frontend.preprocess(4, [("text", "compare these"), *(("image", i.url()) for i in images)])
    runs = pad_runs(pre.routing_token_ids or [])
    assert len(runs) == 3 and len(pre.mm_hashes) == 3
    for run, h in zip(runs, pre.mm_hashes):
        assert set(run.values) == {scalar_pad_value(int(h, 16))}
    assert pre.mm_hashes[0] == pre.mm_hashes[2] != pre.mm_hashes[1]  # the same image, the same hash
    assert [len(r.values) for r in runs] == [4, 8, 4]  # 56x56 -> 2x2 tokens, 100x60 -> 56x112 -> 2x4
    # the worker gets one placeholder per image, and the changed pixel changes the hash
    assert pre.token_ids.count(6) == 3
    changed = frontend.preprocess(4, [("image", Image(56, 56, 1, dot=(3, 3)).url())])
    assert changed.mm_hashes != pre.mm_hashes[:1]


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [3, 16])
def test_routing_sequence_is_padded_to_whole_blocks_with_token_0(mm_oracles, page_size):
    """A quirk of Dynamo 1.6.1 the live model has to avoid: the routing sequence is padded to a whole
    number of blocks with id 0, so a model emitting id 0 would match the padded block by coincidence."""
    frontend, _ = mm_oracles
    pre = frontend.preprocess(page_size, [("text", "describe this image"), ("image", Image(56, 56, 1).url())])
    n = pre.expanded_prompt_len
    assert n == len(pre.token_ids) - 1 + 4
    assert len(pre.routing_token_ids) == -(-n // page_size) * page_size
    assert pre.routing_token_ids[n:] == [0] * (len(pre.routing_token_ids) - n)
