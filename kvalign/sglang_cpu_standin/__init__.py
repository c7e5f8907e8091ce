"""Stand-ins for the parts of SGLang that do not run on a CPU-only machine, for real-engine workers.

SGLang 0.5.23 runs its real server on CPU (``SGLANG_USE_CPU_ENGINE=1``) only with the CPU build
of ``sgl-kernel``, which is not on the package index (its wheels are CUDA builds), and its EAGLE
and prefill/decode code paths need two narrow patches on the ``torch_native`` backend. This
package is everything kvalign adds to a real SGLang process, in one place:

* :mod:`.kernels` — pure-torch versions of the ``sgl_kernel`` ``*_cpu`` functions SGLang imports,
  each tested against SGLang's own Triton kernel (``tests/unit/test_sglang_cpu_standin_kernels.py``);
* :mod:`.ops` — ``torch.ops.sgl_kernel.*`` names SGLang looks up at import time on paths a Llama
  never executes, registered as ops that raise when called;
* :mod:`.patches` — the EAGLE-on-torch_native and fake-transfer patches;
* ``site/`` — the directory put first on ``PYTHONPATH`` of the worker processes *only*: an
  ``sgl_kernel`` package exporting exactly the stand-in names (anything else raises ImportError,
  which SGLang's ``try/except ImportError`` fallbacks rely on) and a ``sitecustomize`` that
  installs the patches in every process SGLang spawns.

It is pinned: :data:`SGLANG_VERSION` is the only SGLang it was written for, and a worker with any
other SGLang stops at start-up with :func:`version_problem`'s message. kvalign's oracles never
import it.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

SGLANG_VERSION = "0.5.23"

#: Put first on PYTHONPATH of real-engine worker processes (and nowhere else).
SITE_DIR = Path(__file__).resolve().parent / "site"

#: Set to "1" in a worker's environment to load the stand-in there.
ENABLE_ENV = "KVALIGN_SGLANG_STANDIN"


def version_problem() -> str | None:
    """Why the stand-in cannot serve the installed SGLang (None when it can)."""
    try:
        installed = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return "sglang is not installed (scripts/setup.sh installs it)"
    if installed != SGLANG_VERSION:
        return (f"kvalign's SGLang CPU stand-in was written for sglang {SGLANG_VERSION}, but sglang {installed} "
                "is installed: the real-engine CPU workers need the pinned version")
    return None


def worker_env(pythonpath: str | None = None) -> dict[str, str]:
    """Environment that loads the stand-in into a worker process (and its SGLang children)."""
    path = str(SITE_DIR) if not pythonpath else f"{SITE_DIR}:{pythonpath}"
    return {ENABLE_ENV: "1", "PYTHONPATH": path, "SGLANG_USE_CPU_ENGINE": "1"}
