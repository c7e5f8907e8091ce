"""Stands in for ``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` (SGLang 0.5.23) on Hopper.

The original is a Blackwell (SM100) CuTe-DSL kernel; it imports ``cutlass`` at module level, and
``sglang.srt.layers.dual_gemm.DualGemm._select_mode`` imports it whenever a Llama MLP is built on
CUDA, only to ask :func:`can_use_dual_gemm`. Its first condition is ``is_sm100_supported()``, false
on an H100, so there the original always answers False and SGLang keeps its ordinary GEMMs. This
module is that answer with the names the callers import (the enum, the decode-token cap), and no
``cutlass``. ``tests/unit/standins/test_sglang_gpu_standin.py`` holds the names, values and signature
to the original's source.
"""

from __future__ import annotations

from enum import IntEnum

#: The original's cap on tokens per dual-GEMM decode launch (read by ``DualGemm``).
MAX_DUAL_GEMM_DECODE_TOKENS = 16


class DualGemmQuantMode(IntEnum):
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        return self is not self.UNQUANT

    @property
    def is_dynamic(self) -> bool:
        return self in (self.DYNAMIC_PER_TENSOR, self.DYNAMIC_PER_TOKEN)

    @property
    def is_per_token(self) -> bool:
        return self in (self.STATIC_PER_TOKEN, self.DYNAMIC_PER_TOKEN)


def can_use_dual_gemm(num_tokens: int, hidden_size: int, intermediate_size: int, quant_mode: DualGemmQuantMode) -> bool:
    """False, as the original answers off SM100; on SM100 the original would launch the cutlass kernel,
    which this stand-in cannot, so it refuses to guess."""
    from sglang.srt.utils import is_sm100_supported

    if is_sm100_supported():
        raise RuntimeError("kvalign's cutedsl_dual_gemm stand-in serves Hopper only: on SM100 SGLang would run "
                           "the CuTe-DSL dual GEMM, which needs nvidia-cutlass-dsl")
    return False
