"""The ``mm`` row of ``check --engine vllm``: image prompts on vLLM's real ``KVCacheManager`` behind the real relay.

vLLM keys an image's blocks by the image's identifier (``MultiModalFeatureSpec.identifier``) and its offset in
the block, and publishes ``(identifier, offset)`` in each such block's ``extra_keys``; an image's placeholder
tokens are one repeated token id, so two images at the same place differ only there. ``dynamo.vllm`` hands vLLM
the frontend's routing hash as the identifier (:func:`~kvalign.model.vllm_keys.dynamo_mm_identifier`); the
relay reads it back and re-hashes the block with it (``block_mm_infos``), and the frontend queries the router
with the same per-block hashes. The row checks, before each prompt of a generated sequence (images drawn from a
pool of three, at any offset and length; prompts share text and images), that vLLM's prefix hit equals
``B * min(R, (n - 1) // B)`` for the router's overlap ``R`` queried with the prompt's ``block_mm_infos``: two
images apart in vLLM are apart in the router, one image shared is credited. A negative control drops the image
keys on the hop (a relay that ignores ``extra_keys``' images): the router keys image blocks by their tokens,
the query's image hashes no longer match, and the row fails ``MM_DROPPED``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from kvalign.model.causes import Cause
from kvalign.model.vllm_keys import block_mm_infos, dynamo_mm_identifier
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.props.vllm.strategies import TAIL, fresh_base

#: token offsets of one example's text (chunk c's i-th token: base + c * B + i), lead and image placeholders
LEAD, IMAGE = 997, 998
#: the frontend's routing hashes of the pool's images (any 64-bit values: Dynamo takes them as given)
IMAGE_HASHES = (0x1111_2222_3333_4444, 0x5555_6666_7777_8888, 0x9999_AAAA_BBBB_CCCC)


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt: text blocks (chunk ids from a pool of 3), ``lead`` text tokens, one image of the pool
    (``length`` placeholder tokens), text blocks after it, a tail of at least one token."""

    before: tuple[int, ...]
    lead: int
    image: int
    length: int
    after: tuple[int, ...]
    tail: int

    def tokens(self, base: int, b: int) -> list[int]:
        def text(chunks: tuple[int, ...]) -> list[int]:
            return [base + c * b + i for c in chunks for i in range(b)]

        return (text(self.before) + [base + LEAD] * self.lead + [base + IMAGE] * self.length + text(self.after)
                + [base + TAIL] * self.tail)

    def images(self, b: int) -> list[tuple[int, int, int]]:
        """``(mm_hash, offset, length)`` of its image."""
        return [(IMAGE_HASHES[self.image], len(self.before) * b + self.lead, self.length)]


def image_prompts(b: int) -> st.SearchStrategy[list[ImagePrompt]]:
    """1-6 prompts: 0-2 text blocks, 0..B-1 lead tokens, an image of 1..2B tokens, 0-2 text blocks, a 1..B-1 tail."""
    chunks = st.lists(st.integers(0, 2), max_size=2).map(tuple)
    one = st.builds(ImagePrompt, chunks, st.integers(0, b - 1), st.integers(0, 2), st.integers(1, 2 * b), chunks,
                     st.integers(1, b - 1))
    return st.lists(one, min_size=1, max_size=6)


def engine_images(images: list[tuple[int, int, int]]) -> list[tuple[str, int, int]]:
    """The images as vLLM's engine core gets them from ``dynamo.vllm``: the marked routing hash as identifier."""
    return [(dynamo_mm_identifier(h), off, n) for h, off, n in images]


def mm_body(worker: Any) -> Any:
    """Before each prompt, vLLM's prefix hit = the prediction from the router's overlap queried with the
    prompt's per-block image hashes; then the prompt is served and its events indexed."""

    def body(seq: list[ImagePrompt]) -> None:
        base, b = fresh_base(), worker.engine.block_size
        for i, prompt in enumerate(seq):
            tokens, images = prompt.tokens(base, b), prompt.images(b)
            hit = worker.engine.match(tokens, mm=engine_images(images))
            credited = worker.tiers(tokens, block_mm_infos=block_mm_infos(len(tokens), b, images))["device_blocks"]
            predicted = b * min(credited, (len(tokens) - 1) // b)
            if hit != predicted:
                cause = Cause.MM_DROPPED if predicted < hit else Cause.MM_IMAGE_REUSED
                raise Mismatch("mm", f"prompt {i} (image {prompt.image} at {images[0][1]}, {prompt.length} tokens): "
                                     f"vLLM reuses {hit} tokens, the router's overlap predicts {predicted}", cause, seq)
            worker.engine.prefill(tokens, mm=engine_images(images))
            worker.sync()

    return body


def drop_mm(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A relay that reads no image from ``extra_keys``: every ``(identifier, offset)`` pair removed."""
    for e in events:
        if e.get("type") == "BlockStored" and e.get("extra_keys"):
            e["extra_keys"] = [None if keys is None else
                               ([k for k in keys if not isinstance(k, (list, tuple))] or None)
                               for keys in e["extra_keys"]]
    return events


#: the control's sequence: one image prompt, then the same prompt again (vLLM reuses its image blocks)
CONTROL_SEQUENCE = [ImagePrompt((0,), 3, 0, 20, (1,), 2), ImagePrompt((0,), 3, 0, 20, (1,), 2)]


def row(worker: Any, n: int, seed: int | None) -> Any:
    """The ``mm`` row on ``worker`` (the rows' shared vLLM engine), with its negative control."""
    from kvalign.verify.props.vllm.running import control_run, search_row

    return search_row("mm", mm_body(worker), image_prompts(worker.engine.block_size), n, seed,
                      ("drop_mm (the relay reads no image from extra_keys)",
                       control_run(worker, mm_body(worker), CONTROL_SEQUENCE, seed, drop_mm), Cause.MM_DROPPED))
