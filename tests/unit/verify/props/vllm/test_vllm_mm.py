"""Image prompts on vLLM behind the real relay and router (``check --engine vllm``'s ``mm`` row).

vLLM's real ``KVCacheManager`` keys image blocks by each image's identifier (a ``MultiModalFeatureSpec`` per
image, on CPU: no encoder runs) and publishes ``(identifier, offset)`` in ``extra_keys``; Dynamo's real relay
re-keys those blocks with the image's routing hash, and the router is queried with the prompt's per-block
image hashes. Before each prompt, vLLM's prefix hit = the prediction from the router's overlap: two images at
the same placeholders stay apart, one image shared is credited. Negative control: a hop dropping the images
from ``extra_keys`` (``MM_DROPPED``). A candidate finding: an identifier not in Dynamo's marked form is not
read as an image at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import strategies as st
from vllm_paths import vllm_on_router

from kvalign.model.causes import Cause
from kvalign.verify.engine.search import run_search
from kvalign.verify.props.vllm import controls
from kvalign.verify.props.vllm.mm import (CONTROL_SEQUENCE, ImagePrompt, drop_mm, engine_images, image_prompts,
                                          mm_body)
from kvalign.verify.props.vllm.strategies import fresh_base

B = 16


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    with vllm_on_router(B, 20) as w:
        yield w


def test_vllms_hit_equals_the_prediction_from_the_routers_image_aware_overlap(worker):
    cases, failures, found = run_search(mm_body(worker), image_prompts(B), 20, seed=0)
    assert (cases, failures, found) == (20, 0, None)


def _credit_and_hit(worker: Any, prompt: ImagePrompt, base: int) -> tuple[int, int]:
    from kvalign.model.vllm_keys import block_mm_infos

    tokens, images = prompt.tokens(base, B), prompt.images(B)
    credited = worker.tiers(tokens, block_mm_infos=block_mm_infos(len(tokens), B, images))["device_blocks"]
    return credited, worker.engine.match(tokens, mm=engine_images(images)) // B


def test_one_image_shared_is_credited_and_two_images_apart_are_not(worker):
    base = fresh_base()
    first = ImagePrompt((0,), 0, 0, 2 * B, (1,), 3)  # text block, image on blocks 1-2, text block 3
    worker.engine.prefill(first.tokens(base, B), mm=engine_images(first.images(B)))
    worker.sync()
    assert _credit_and_hit(worker, first, base) == (4, 4)
    other = ImagePrompt((0,), 0, 1, 2 * B, (1,), 3)  # the same tokens, another image
    assert _credit_and_hit(worker, other, base) == (1, 1)  # the text block before the image only


def test_negative_control_a_relay_ignoring_images_is_caught(worker):
    with controls.on_hop(worker, drop_mm):
        _cases, _failures, found = run_search(mm_body(worker), st.just(CONTROL_SEQUENCE), 5, seed=0)
    assert found is not None and found.cause is Cause.MM_DROPPED
    assert "prompt 1" in found.detail and "vLLM reuses 48 tokens, the router's overlap predicts 16" in found.detail


def test_finding_an_unmarked_image_identifier_is_keyed_by_tokens_only(worker):
    """vLLM keys an image by whatever identifier it gets; the relay reads one back only in Dynamo's marked form
    (16 hex digits, 48 zeros). Where ``dynamo.vllm`` passes no frontend hash (the frontend's exact image routing
    off), vLLM's own 64-hex identifiers reach the relay and every image's blocks are keyed by their placeholder
    tokens: the router, queried as that frontend queries (no image hashes), credits a prompt with another image
    all the blocks of the first, where vLLM reuses the text before the image only."""
    base, first, second = fresh_base(), "ab" * 32, "cd" * 32  # two native vLLM identifiers (sha256 hex digests)
    prompt = ImagePrompt((0,), 0, 0, 2 * B, (1,), 3)
    tokens, (_h, offset, length) = prompt.tokens(base, B), prompt.images(B)[0]
    worker.engine.prefill(tokens, mm=[(first, offset, length)])
    worker.sync()
    assert worker.engine.match(tokens, mm=[(second, offset, length)]) == B  # vLLM: the text block only
    assert worker.tiers(tokens)["device_blocks"] == 4  # the router: all four blocks
