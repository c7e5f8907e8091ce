"""Import-only placeholder for the ``flash_mla`` package (FlashMLA's CUDA kernels), not in the GPU bundle.

SGLang 0.5.23's EAGLE worker imports ``FlashMLABackend`` while capturing CUDA graphs only to list the
backends it may graph (``speculative/eagle_worker_v2.py`` ~597), and that module imports ``flash_mla``
at load. kvalign's tiny Llama runs SGLang's triton backend and never calls FlashMLA: every name here
raises if called, so a model that did need it stops with this message instead of running wrong.
Pinned to SGLang 0.5.23 (``sglang/kernels/ops/attention/flash_mla_interface.py`` imports exactly these).
"""

from __future__ import annotations

from typing import Any


def fused_norm_rope_attn_rope_cast(*_args: Any, **_kwargs: Any) -> Any:
    raise NotImplementedError("kvalign's GPU stand-in has no FlashMLA kernels (flash_mla is a placeholder)")
