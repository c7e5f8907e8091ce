"""Stand-ins that let SGLang's HiCache (host KV tier) run inside a real CPU engine.

The live layer's real ``dynamo.sglang`` workers run with ``--enable-hierarchical-cache`` on this
CPU: SGLang's own ``HybridCacheController``, host pool, radix-cache tiering, load-back threshold and
KV events, with two CUDA-only pieces stood in:

* :mod:`.pinned` — the host pool's page-locking (``torch.cuda.cudart().cudaHostRegister``);
* :mod:`.kvcacheio` — ``sgl_kernel.kvcacheio``'s device<->host transfer ops, as torch copies;

put in place by :mod:`.patches` through the CPU engine stand-in's import hooks
(:mod:`kvalign.standins.sglang_cpu.hooks`), so they exist in worker processes only. Unlike
:mod:`kvalign.standins.hicache` (the ``tier`` rows' stand-in, which replaces the whole transfer
controller with one that moves no bytes), KV bytes move here, through SGLang's real controller.

Pinned per release: :data:`SUPPORTED` lists the SGLang releases whose host pool this was read
against and tested with; the write policies are the tier stand-in's
(:data:`kvalign.standins.hicache.WRITE_POLICIES`).
"""

from __future__ import annotations

from kvalign.standins.hicache import WRITE_POLICIES

#: SGLang releases whose host pool (``mem_cache/pool_host/{common,mha}.py``) the patches were written for.
SUPPORTED = ("0.5.19", "0.5.21", "0.5.23")

__all__ = ["SUPPORTED", "WRITE_POLICIES", "version_problem"]


def version_problem(version: str) -> str | None:
    """Why live HiCache cannot run with this SGLang release (None when it can)."""
    if version in SUPPORTED:
        return None
    return (f"kvalign's HiCache CPU stand-in (kvalign/standins/hicache_cpu/) supports SGLang {', '.join(SUPPORTED)}, "
            f"not {version}: its host pool was not read against that release")
