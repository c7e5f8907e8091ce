"""Names SGLang 0.5.23 binds at import time on CPU but never calls for a Llama + EAGLE3 (topk 1,
one draft step) on the torch_native backend: present so the imports succeed, raising if called.

``torch.ops.sgl_kernel.*`` lookups happen at module import (e.g. ``models/qwen3_5.py``, reached
from ``dynamo.sglang``'s registration through its multimodal routing); ``from sgl_kernel import``
of multi-layer-EAGLE / intel_amx helpers likewise. A call means the worker took a path the
stand-in does not cover, and it says so instead of computing something wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

#: ``torch.ops.sgl_kernel.<name>`` looked up at import time (found by importing
#: ``dynamo.sglang.main`` with SGLANG_USE_CPU_ENGINE=1 and this stand-in).
IMPORT_TIME_OPS = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_gdn_gating_cpu",
    "apply_rotary_pos_emb_cpu",
)

#: ``from sgl_kernel import <name>`` of multi-layer EAGLE and the intel_amx backend.
UNCOVERED_FUNCTIONS = ("rotate_input_ids_cpu", "build_draft_decode_metadata_cpu")

_library: Any = None


def _unsupported(name: str) -> Callable[..., NoReturn]:
    def call(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not covered by kvalign's SGLang CPU stand-in (multi-layer EAGLE, "
            "intel_amx or a non-Llama model): run the real CPU build of sgl-kernel for this path")

    call.__name__ = name
    return call


def register() -> None:
    """Register :data:`IMPORT_TIME_OPS` under ``torch.ops.sgl_kernel`` as raising ops (once)."""
    global _library
    if _library is not None:
        return
    import torch

    lib = torch.library.Library("sgl_kernel", "DEF")
    for name in IMPORT_TIME_OPS:
        lib.define(f"{name}(Tensor[] args) -> Tensor")
        lib.impl(name, _unsupported(name), "CompositeExplicitAutograd")
    _library = lib


def uncovered_functions() -> dict[str, Callable[..., NoReturn]]:
    """The raising stand-ins for :data:`UNCOVERED_FUNCTIONS`, by name."""
    return {name: _unsupported(name) for name in UNCOVERED_FUNCTIONS}
