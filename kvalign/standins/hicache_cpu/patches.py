"""The two patches that put :mod:`.pinned` and :mod:`.kvcacheio` where SGLang's host pool looks.

Installed at import (by :mod:`kvalign.standins.sglang_cpu.hooks`, in real-engine worker processes
only), each after checking that the SGLang code still looks as written for:

* :func:`host_register_on_cpu` — ``pool_host/common.py`` reads ``torch.cuda.cudart()`` inside
  ``_cuda_host_register`` / ``_cuda_host_unregister``; that module's ``torch`` becomes
  :func:`.pinned.torch_with_cudart` (every other name is torch's own).
* :func:`kvcacheio_on_cpu` — ``pool_host/mha.py`` imports its transfer ops from
  ``sgl_kernel.kvcacheio`` only ``if _is_cuda or _is_hip`` (XPU and NPU take their own wheels), so
  on a CPU engine the names are unbound and the first backup raises ``NameError``. They are bound
  from ``sgl_kernel.kvcacheio`` — the CPU stand-in's (``site/sgl_kernel/kvcacheio.py``, which is
  :mod:`.kvcacheio`) — exactly as that import would bind them on CUDA.
"""

from __future__ import annotations

import inspect
from typing import Any

from kvalign.standins.sglang_cpu.patches import _require


def host_register_on_cpu() -> None:
    """``torch.cuda.cudart()`` of the host pool's registration code -> :data:`.pinned.REGISTRY`."""
    from sglang.srt.mem_cache.pool_host import common

    from kvalign.standins.hicache_cpu.pinned import torch_with_cudart

    for fn in (common._cuda_host_register, common._cuda_host_unregister):
        _require("torch.cuda.cudart()" in inspect.getsource(fn),
                 f"pool_host.common.{fn.__name__} no longer calls torch.cuda.cudart()")
    _require("cudaHostRegister" in inspect.getsource(common._cuda_host_register) and
             "cudaHostUnregister" in inspect.getsource(common._cuda_host_unregister_ranges),
             "the host pool no longer registers through cudaHostRegister / cudaHostUnregister")
    common.torch = torch_with_cudart()


def kvcacheio_on_cpu() -> None:
    """Bind ``mha.py``'s ``sgl_kernel.kvcacheio`` names from the stand-in (CPU engine: they are unbound)."""
    from sglang.srt.mem_cache.pool_host import mha

    import sgl_kernel.kvcacheio as kvcacheio

    _require(not any(getattr(mha, flag, False) for flag in ("_is_cuda", "_is_hip", "_is_xpu")),
             "the host pool runs on a GPU build here: nothing to stand in")
    source = inspect.getsource(mha)
    _require("if _is_cuda or _is_hip:\n    from sgl_kernel.kvcacheio import (" in source,
             "pool_host/mha.py no longer imports its transfer ops from sgl_kernel.kvcacheio under `if _is_cuda or _is_hip`")
    called = [name for name in kvcacheio.EXPORTS if f"{name}(" in source]
    _require(bool(called), "pool_host/mha.py calls none of the kvcacheio ops the stand-in provides")
    for name in called:
        _require(not hasattr(mha, name), f"pool_host/mha.py already binds {name} on this machine")
        setattr(mha, name, getattr(kvcacheio, name))


def storage_scratch_on_cpu() -> None:
    """``MHATokenToKVPoolHost.get_dummy_flat_data_page`` (the scratch page a storage read lands in when
    a page is not wanted) allocates with ``pin_memory=self.pin_memory``; CPU torch has no pinned
    allocator and raises, so every refill from a storage backend fails ("HiCache prefetch transfer
    failed"). On a CPU the host is the device: SGLang's own allocation runs with the flag off."""
    from sglang.srt.mem_cache.pool_host import mha

    cls = mha.MHATokenToKVPoolHost
    original = cls.get_dummy_flat_data_page
    _require("pin_memory=self.pin_memory" in inspect.getsource(original),
             "pool_host/mha.py's get_dummy_flat_data_page no longer allocates with pin_memory=self.pin_memory")

    def get_dummy_flat_data_page(self: Any) -> Any:
        pinned, self.pin_memory = self.pin_memory, False
        try:
            return original(self)
        finally:
            self.pin_memory = pinned

    cls.get_dummy_flat_data_page = get_dummy_flat_data_page
