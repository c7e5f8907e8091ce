"""``torch.cuda.cudart()`` for the host pool's pinned allocation, on a CPU engine.

SGLang's host pool allocates its KV buffer in host memory and page-locks it for DMA:
``MHATokenToKVPoolHost(pin_memory=True)`` -> ``alloc_with_host_register`` ->
``_cuda_host_register`` (``sglang/srt/mem_cache/pool_host/common.py``), which calls
``torch.cuda.cudart().cudaHostRegister(ptr, size, 0)`` chunk by chunk, keeps the registered ranges
on the tensor, and ``cudaHostUnregister``\\ s each base on ``destroy``. On a CPU-only machine the
"device" is the host: there is nothing to page-lock, and CPU torch has no CUDA runtime at all.

:class:`HostRegistry` stands in for the three runtime calls SGLang makes, with the CUDA runtime's
documented contract (CUDA Runtime API, Memory Management) so that SGLang's own registration code
runs unchanged and is held to it:

* ``cudaHostRegister(ptr, size, flags)``: ``cudaSuccess`` (0); ``cudaErrorInvalidValue`` (1) for a
  null pointer or a zero size; ``cudaErrorHostMemoryAlreadyRegistered`` (712) if any byte of the
  range is registered already;
* ``cudaHostUnregister(ptr)``: 0 when ``ptr`` is the base of a registered range (which it releases);
  ``cudaErrorHostMemoryNotRegistered`` (713) otherwise;
* ``cudaGetErrorString(rc)``: the runtime's message for those codes.

Only ``sglang.srt.mem_cache.pool_host.common`` sees it (:func:`torch_with_cudart`): the rest of the
worker keeps CPU torch's ``torch.cuda``.
"""

from __future__ import annotations

import threading
import types
from typing import Any

SUCCESS, INVALID_VALUE, ALREADY_REGISTERED, NOT_REGISTERED = 0, 1, 712, 713
_MESSAGES = {
    SUCCESS: "no error",
    INVALID_VALUE: "invalid argument",
    ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
    NOT_REGISTERED: "pointer does not correspond to a registered memory region",
}


class HostRegistry:
    """The registered host ranges of one process, as the CUDA runtime keeps them."""

    def __init__(self) -> None:
        self._ranges: dict[int, int] = {}  # base -> size
        self._lock = threading.Lock()

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - the runtime's name
        if not ptr or size <= 0:
            return INVALID_VALUE
        with self._lock:
            if any(ptr < base + n and base < ptr + size for base, n in self._ranges.items()):
                return ALREADY_REGISTERED
            self._ranges[ptr] = size
        return SUCCESS

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        with self._lock:
            return SUCCESS if self._ranges.pop(ptr, None) is not None else NOT_REGISTERED

    def cudaGetErrorString(self, rc: int) -> str:  # noqa: N802
        return _MESSAGES.get(int(rc), f"unrecognized error code {int(rc)}")

    def registered(self) -> dict[int, int]:
        """base -> size of every range registered now (what a leak check reads)."""
        with self._lock:
            return dict(self._ranges)


#: The worker process's registry (one CUDA context per process, as on a GPU).
REGISTRY = HostRegistry()


class _CudaView(types.ModuleType):
    def __init__(self, registry: HostRegistry, cuda: types.ModuleType) -> None:
        super().__init__("torch.cuda")
        self._registry = registry
        self._cuda = cuda

    def cudart(self) -> HostRegistry:
        return self._registry

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cuda, name)


class _TorchView(types.ModuleType):
    """``torch`` as one SGLang module sees it: everything torch's, but ``torch.cuda.cudart()``.

    torch is imported when a view is made (in a worker, which holds it already), not with this module:
    the registry alone needs no torch (its tests run without it)."""

    def __init__(self, registry: HostRegistry) -> None:
        import torch

        super().__init__("torch")
        self._torch = torch
        self.cuda = _CudaView(registry, torch.cuda)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def torch_with_cudart(registry: HostRegistry = REGISTRY) -> types.ModuleType:
    """The ``torch`` a module gets in place of the real one so its ``torch.cuda.cudart()`` is ``registry``."""
    return _TorchView(registry)
