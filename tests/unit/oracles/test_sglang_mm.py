"""SGLang's real multimodal path on CPU: the pad values its radix tree keys an image by (``slow``:
it starts SGLang's processor and Dynamo's frontend, ``mm_oracles``)."""

from __future__ import annotations

import pytest

from kvalign.model.mm_keys import pad_runs
from kvalign.standins.sglang_scalar_pads import scalar_pad_value, scalar_pads
from kvalign.verify.props.mm.controls import drop_mm_hashes
from kvalign.verify.props.mm.strategies import Image

pytestmark = pytest.mark.slow

PARTS = [("text", "describe this image"), ("image", Image(56, 56, 3).url()), ("text", "what is"),
         ("image", Image(84, 56, 4).url())]


def sglang_pad_values(item_hash: int) -> tuple[int, ...]:
    from sglang.srt.managers.schedule_batch import _compute_pad_values

    return _compute_pad_values(item_hash.to_bytes(8, byteorder="big"))


def test_forwarded_hashes_key_each_image_by_sglangs_wide_sentinels(mm_oracles):
    frontend, sglang = mm_oracles
    pre = frontend.preprocess(4, PARTS)
    eng = sglang.process(pre.request)
    assert eng.forwarded == pre.mm_hashes and sglang.takes_hashes
    assert [it.hash for it in eng.items] == [int(h, 16) for h in pre.mm_hashes]
    runs = pad_runs(eng.padded)
    assert [len(r.values) for r in runs] == [4, 6] == [e - s + 1 for it in eng.items for s, e in it.offsets]
    for run, h in zip(runs, pre.mm_hashes):
        values = sglang_pad_values(int(h, 16))
        assert len(values) == 4 and max(values) > 0xFFFFFFFF
        assert list(run.values) == [values[i % 4] for i in range(len(run.values))]
    # the text around the images is the worker's prompt, expanded in place
    assert [t for t in eng.padded if t < 1_000_000] == [t for t in pre.token_ids if t != 6]


def test_without_the_frontends_hash_sglang_hashes_the_pixels(mm_oracles):
    frontend, sglang = mm_oracles
    pre = frontend.preprocess(4, PARTS)
    eng = sglang.process(drop_mm_hashes(pre).request)
    assert eng.forwarded is None
    assert all(it.hash is not None and it.hash != int(h, 16) for it, h in zip(eng.items, pre.mm_hashes))
    again = sglang.process(drop_mm_hashes(pre).request)
    assert [it.hash for it in again.items] == [it.hash for it in eng.items]  # deterministic: same pixels, same hash


def test_scalar_pad_stand_in_keys_images_as_the_frontend(mm_oracles):
    frontend, sglang = mm_oracles
    pre = frontend.preprocess(4, PARTS)
    with scalar_pads():
        eng = sglang.process(pre.request)
    assert eng.padded == pre.routing_token_ids[: len(eng.padded)]
    assert [set(r.values) for r in pad_runs(eng.padded)] == [{scalar_pad_value(int(h, 16))} for h in pre.mm_hashes]
    # and the stand-in is gone after the block
    assert max(sglang.process(pre.request).padded) > 0xFFFFFFFF
