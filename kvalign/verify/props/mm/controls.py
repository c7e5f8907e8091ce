"""Negative controls of the ``mm`` property: one deliberately broken piece each, each with its cause.

A control runs on an *aligned* baseline: the pinned SGLang 0.5.23 keys images by 62-bit
sentinels that no router token can hold, so on it every control would fail with ``MM_PAD_WIDTH``
and prove nothing about itself. The baseline loads SGLang 0.5.21's scalar pad rule
(:mod:`kvalign.standins.sglang_scalar_pads`, what the shipped pair keys images by), on which the
property holds; each control then breaks one thing, as it broke upstream:

* ``drop_mm_hashes`` — the worker does not pass the frontend's image hashes on (a ``dynamo.sglang``
  whose engine predates ``mm_hashes``, or a launcher that skipped the multimodal path: Dynamo
  #10999): SGLang hashes the pixels itself;
* ``skip_mm_routing`` — the frontend builds no multimodal routing sequence (a model its registry
  does not cover, or a missing ``preprocessor_config.json``): the router hashes one placeholder per image;
* ``pad_formula`` — the frontend derives its pad value from the image hash by another formula than
  SGLang (here one more: any formula change looks the same to the router);
* ``count_plus_one`` — the frontend counts one placeholder token more per image than SGLang's
  processor (a resize rule that rounds differently);
* ``constant_image_hash`` — both sides key every image by one hash (the frontend hashing a URL
  whose content changed, or a hash format whose low bits are lost): a changed image is credited;
* ``eagle_window_at_image`` — an EAGLE router that ends a block's window where an image starts,
  instead of reading one token into it as SGLang's bigram page does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvalign.model.causes import Cause
from kvalign.oracles.frontend_mm import Preprocessed
from kvalign.model.mm_keys import MM_PAD_SHIFT_VALUE, pad_runs
from kvalign.standins.sglang_scalar_pads import scalar_pad_value, scalar_pads
from kvalign.verify.props.mm.body import MmSystems


def _with_request(pre: Preprocessed, **changes: Any) -> Preprocessed:
    return dataclasses.replace(pre, request={**pre.request, **changes})


def drop_mm_hashes(pre: Preprocessed) -> Preprocessed:
    extra = {k: v for k, v in (pre.request.get("extra_args") or {}).items() if k not in ("mm_hashes", "mm_hashes_by_modality")}
    return _with_request(pre, extra_args=extra)


def skip_mm_routing(pre: Preprocessed) -> Preprocessed:
    return dataclasses.replace(pre, routing_token_ids=None, block_mm_infos=None, expanded_prompt_len=None)


def _map_runs(pre: Preprocessed, fn: Callable[[list[int]], list[int]]) -> Preprocessed:
    tokens = pre.router_tokens
    out, last = [], 0
    for run in pad_runs(tokens):
        out += tokens[last:run.start] + fn(list(run.values))
        last = run.end
    return dataclasses.replace(pre, routing_token_ids=out + tokens[last:])


def pad_formula(pre: Preprocessed) -> Preprocessed:
    return _map_runs(pre, lambda vs: [v + 1 for v in vs])


def count_plus_one(pre: Preprocessed) -> Preprocessed:
    return _map_runs(pre, lambda vs: vs + vs[-1:])


def constant_image_hash(pre: Preprocessed) -> Preprocessed:
    zero = "0" * 16
    hashes = [zero] * len(pre.mm_hashes or [])
    extra = {**(pre.request.get("extra_args") or {}), "mm_hashes": hashes}
    pre = dataclasses.replace(_with_request(pre, extra_args=extra), mm_hashes=hashes)
    return _map_runs(pre, lambda vs: [scalar_pad_value(0)] * len(vs))


def eagle_window_at_image(tokens: Sequence[int], kv_block_size: int, block_mm_infos: Any = None,
                          lora_name: str | None = None, is_eagle: bool | None = None,
                          cache_namespace: str | None = None) -> list[int]:
    """The installed router's hashes, except that in EAGLE mode a block whose B+1 window reaches
    exactly one token into an image is hashed without that token."""
    from kvalign.verify.misaligned import _real

    real = _real()
    out = [int(h) for h in real(tokens, kv_block_size, block_mm_infos, lora_name, is_eagle, cache_namespace)]
    if not is_eagle:
        return out
    b = kv_block_size
    for i in range(len(out)):
        window = list(tokens[i * b: i * b + b + 1])
        if len(window) == b + 1 and window[-1] >= MM_PAD_SHIFT_VALUE > window[-2]:
            out[i] = int(real(window[:b], b, None, lora_name, False, cache_namespace)[0])
    return out


@dataclasses.dataclass(frozen=True)
class Control:
    name: str
    cause: Cause
    transform: Callable[[Preprocessed], Preprocessed] | None = None
    hasher: Any = None
    modes: tuple[str, ...] = ("plain", "eagle")


CONTROLS: dict[str, Control] = {c.name: c for c in (
    Control("drop_mm_hashes", Cause.MM_HASH_NOT_FORWARDED, transform=drop_mm_hashes),
    Control("skip_mm_routing", Cause.MM_ROUTING_SKIPPED, transform=skip_mm_routing),
    Control("pad_formula", Cause.MM_PAD_VALUES, transform=pad_formula),
    Control("count_plus_one", Cause.MM_PLACEHOLDER_COUNT, transform=count_plus_one),
    Control("constant_image_hash", Cause.MM_IMAGE_REUSED, transform=constant_image_hash),
    Control("eagle_window_at_image", Cause.MM_EAGLE_WINDOW, hasher=eagle_window_at_image, modes=("eagle",)),
)}


def controlled(base: MmSystems, control: Control) -> MmSystems:
    """``base`` with the control's piece swapped in."""
    changes: dict[str, Any] = {}
    if control.transform is not None:
        changes["transform"] = control.transform
    if control.hasher is not None:
        changes.update(hasher=control.hasher, real_hasher=False)
    return dataclasses.replace(base, **changes)


@contextmanager
def aligned_baseline() -> Iterator[None]:
    """SGLang keys images as the shipped pair does (0.5.21's scalar pad value) for the ``with`` block."""
    with scalar_pads():
        yield
