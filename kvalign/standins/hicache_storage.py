"""Stand-in for the CUDA pieces under SGLang's HiCache storage tier (L3), in kvalign's own process, for ``storage``.

The ``storage`` rows run SGLang's real ``UnifiedRadixCache`` with its real ``HybridCacheController``,
its real host pool (``MHATokenToKVPoolHost``) and its real ``file`` storage backend
(``HiCacheFile``): the device<->host copies and the host<->file pages are real bytes. Four pieces
stand in, the first three the live engine's (:mod:`kvalign.standins.hicache_cpu`):

* the host pool's page-locking: :func:`kvalign.standins.hicache_cpu.patches.host_register_on_cpu`;
* the ``sgl_kernel.kvcacheio`` transfer ops: :mod:`kvalign.standins.hicache_cpu.kvcacheio`, bound
  by :func:`kvalign.standins.hicache_cpu.patches.kvcacheio_on_cpu` (the module is put under
  ``sgl_kernel.kvcacheio`` only while that patch imports it, when no ``sgl_kernel`` is installed);
* the host pool's scratch page for a storage read (``get_dummy_flat_data_page``), which asks torch for
  pinned memory; CPU torch has no pinned allocator:
  :func:`kvalign.standins.hicache_cpu.patches.storage_scratch_on_cpu` (the live engine's too);
* the pinned ranges of an engine's host pool, given back when it closes (:func:`release_pinned`).

In the live engine they are installed at import in worker processes; here, once per process, on
first use (:func:`install`). Pinned to :data:`SUPPORTED`.
"""

from __future__ import annotations

import sys
import types
from functools import cache

from kvalign.errors import OracleUnavailable

#: SGLang releases whose storage path (controller, host pool, ``HiCacheFile``) this was read against.
SUPPORTED = ("0.5.23",)


def version_problem(version: str) -> str | None:
    if version in SUPPORTED:
        return None
    return (f"kvalign's HiCache storage stand-in (kvalign/standins/hicache_storage.py) is pinned to SGLang "
            f"{', '.join(SUPPORTED)}; SGLang {version}'s storage path is unchecked")


@cache
def install() -> None:
    """The host pool's registration and transfer ops on CPU, in this process (once)."""
    from kvalign.standins.hicache_cpu import kvcacheio
    from kvalign.standins.hicache_cpu.patches import host_register_on_cpu, kvcacheio_on_cpu, storage_scratch_on_cpu
    from kvalign.standins.sglang_cpu.patches import StandinMismatch

    seeded = "sgl_kernel" not in sys.modules
    if seeded:
        package = types.ModuleType("sgl_kernel")
        package.__path__ = []
        package.kvcacheio = kvcacheio  # type: ignore[attr-defined]
        sys.modules["sgl_kernel"], sys.modules["sgl_kernel.kvcacheio"] = package, kvcacheio
    try:
        host_register_on_cpu()
        kvcacheio_on_cpu()
        storage_scratch_on_cpu()
    except StandinMismatch as exc:
        raise OracleUnavailable(f"HiCache storage on CPU: {exc}") from None
    finally:
        if seeded:
            sys.modules.pop("sgl_kernel", None)
            sys.modules.pop("sgl_kernel.kvcacheio", None)


def pinned_ranges() -> set[int]:
    """The bases of the host ranges registered in this process now (before an engine's pool is built)."""
    from kvalign.standins.hicache_cpu.pinned import REGISTRY

    return set(REGISTRY.registered())


def release_pinned(before: set[int]) -> None:
    """Unregister what an engine's host pool registered since ``before``. SGLang's pool unregisters its
    ranges only on CUDA / HIP (``pool_host/base.py``: ``self.pin_memory and (_is_cuda or _is_hip)``); a
    live CPU worker has one pool for life, but ``storage`` builds one per example, and a freed buffer's
    addresses are reused: the registry would refuse the next pool (``cudaErrorHostMemoryAlreadyRegistered``)."""
    from kvalign.standins.hicache_cpu.pinned import REGISTRY

    for base in set(REGISTRY.registered()) - before:
        REGISTRY.cudaHostUnregister(base)
