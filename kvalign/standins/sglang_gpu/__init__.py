"""What kvalign adds to a real SGLang process on the GPU machine, in one place, pinned to its release.

The GPU machine has torch 2.11.0+cu130 and no package registry. SGLang 0.5.23 pins ``sglang-kernel``
0.4.10, built for torch 2.14.1; 0.4.5 is the last release built for torch 2.11 and carries the
kernels SGLang's triton-attention path calls (``scripts/gpu/pack.py`` ships it). Three things stand
between that pair and a running engine, and each is handled here rather than by editing SGLang:

* SGLang refuses a kernel older than 0.4.9 at start-up: ``SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1``;
* SGLang's Rust radix-tree core (``tch`` 0.24 bindings for a newer libtorch) panics on this torch
  at the first insert (``UnknownKind(32)``): ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python`` runs
  SGLang's own Python core (the CPU layer checks both cores against kvalign's model);
* ``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` imports ``cutlass`` (nvidia-cutlass-dsl, not
  carried) whenever a Llama MLP is built on CUDA: :mod:`.cutedsl_dual_gemm` stands in for it.

With the ``fake`` transfer backend (kvalign's tiny target on one GPU, where no KV bytes need to
move) the prefill and decode workers also need SGLang's three fake-transfer gaps closed, the same
patches the CPU engine uses (:mod:`kvalign.standins.sglang_cpu.patches`). Nothing here touches
HiCache: on CUDA it runs SGLang's own pinned host memory and ``kvcacheio`` kernels.

``site/`` goes first on ``PYTHONPATH`` of the GPU worker processes only; kvalign's oracles never
import this package.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

#: The SGLang release this was written and run for, and the kernel release it runs with.
SGLANG_VERSION = "0.5.23"
SGLANG_KERNEL_VERSION = "0.4.5"

#: Put first on PYTHONPATH of real-engine GPU worker processes (and nowhere else).
SITE_DIR = Path(__file__).resolve().parent / "site"
#: Set to "1" in a worker's environment to load the stand-in there.
ENABLE_ENV = "KVALIGN_SGLANG_GPU_STANDIN"

#: SGLang's own switches this pair needs (module docstring).
SGLANG_ENV = {"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}


def version_problem(sglang: str | None = None, kernel: str | None = None) -> str | None:
    """Why the stand-in cannot serve the installed (or given) SGLang and sglang-kernel; None when it can."""
    try:
        sglang = sglang or metadata.version("sglang")
        kernel = kernel or metadata.version("sglang-kernel")
    except metadata.PackageNotFoundError as exc:
        return f"{exc.name} is not installed (scripts/gpu/pack.py bundles it for the GPU machine)"
    if (sglang, kernel) != (SGLANG_VERSION, SGLANG_KERNEL_VERSION):
        return (f"kvalign's SGLang GPU stand-in was written for sglang {SGLANG_VERSION} with sglang-kernel "
                f"{SGLANG_KERNEL_VERSION}, not sglang {sglang} with sglang-kernel {kernel}")
    return None


def worker_env(pythonpath: str | None = None) -> dict[str, str]:
    """Environment that loads the stand-in into a GPU worker process (and its SGLang children)."""
    path = str(SITE_DIR) if not pythonpath else f"{SITE_DIR}:{pythonpath}"
    return {ENABLE_ENV: "1", "PYTHONPATH": path, **SGLANG_ENV}
