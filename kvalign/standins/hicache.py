"""Stand-in for the CUDA transfer path of SGLang's HiCache (host KV tier), for the ``tier`` property.

Everything kvalign puts in place of a real SGLang part to turn the host tier of a real
``UnifiedRadixCache`` on, without a GPU, is in this one module; nothing else in kvalign builds or
touches these objects. It is written for, and pinned to, :data:`SUPPORTED` (SGLang 0.5.23): with any
other SGLang, :func:`attach_host_tier` raises :class:`~kvalign.oracles.base.OracleUnavailable` and
the tier rows are skipped with that reason.

What is real: the cache, its tree core (Rust or Python), every tiering decision (write-through
after the first or second hit, write-back on eviction, demotion, host eviction, load-back and its
``load_back_threshold``), the events it emits, and :meth:`UnifiedRadixCache.init_hicache` itself,
which sets ``write_through_threshold``, ``is_write_back`` and ``load_back_threshold`` from the
write policy. What stands in:

* :class:`StubTransferController` replaces ``HybridCacheController``: ``write`` allocates host slot
  ids from a counting :class:`StubHostPool` and queues an already-finished ack; ``load`` allocates
  the device slots from the cache's own device allocator (SGLang's ``PagedTokenToKVPoolAllocator``,
  bounded, so a load can find it full as ``HybridCacheController.load`` can) and queues an
  already-finished ack. No KV bytes exist or move, so a transfer never fails or lags: the stand-in
  says nothing about transfer timing.
* ``attach_hybrid_pool_to_unified_cache`` (which builds the host pools and the controller from a
  real KV pool, ``torch.cuda`` pinned memory and ``sgl_kernel.kvcacheio`` ops) is replaced, for
  the duration of ``init_hicache`` only, by one that attaches the stubs, as its
  ``_apply_stack_result`` would.

``init_hicache`` reads the server's config (``get_memory()`` / ``get_observability()``) from the
context it runs in: SGLang's own config bags for ``--enable-hierarchical-cache --hicache-write-policy
POLICY`` (:func:`kvalign.standins.scheduler.scheduler_context`).

Why not the real controller: every host IO backend calls ``sgl_kernel.kvcacheio`` CUDA ops with no
torch fallback (``mem_cache/pool_host/mha.py``), and the host pool pins memory through
``torch.cuda.cudart()`` by default.
"""

from __future__ import annotations

import atexit
import itertools
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvalign.errors import OracleUnavailable

#: SGLang releases this stand-in was written against and checked with (tests/unit/verify/props/tier/test_check_tier.py).
SUPPORTED = ("0.5.23",)
#: ``--hicache-write-policy`` values of those releases.
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


def version_problem(version: str) -> str | None:
    """Why the stand-in cannot run with this SGLang, or None."""
    if version in SUPPORTED:
        return None
    return (f"kvalign's HiCache transfer stand-in (kvalign/standins/hicache.py) is pinned to SGLang "
            f"{', '.join(SUPPORTED)}; SGLang {version}'s host-tier internals are unchecked")


class _Done:
    """A CUDA event that has already completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Ack:
    """The fields of SGLang's ``HiCacheAck`` that ``writing_check`` / ``loading_check`` read."""

    def __init__(self, node_ids: list[int]) -> None:
        self.node_ids = node_ids
        self.start_event = self.finish_event = _Done()
        self.num_tokens = 0
        self.num_tokens_by_pool: dict[str, int] = {}
        self.num_bytes = 0
        self.timing_enabled = False


class StubHostPool:
    """Host KV slots as ids only: ``size`` tokens; alloc returns None when full (as the real pool)."""

    shared_allocation_domain = None

    def __init__(self, size: int) -> None:
        self.size = size
        self.used: set[int] = set()
        self._next = itertools.count()

    def available_size(self) -> int:
        return self.size - len(self.used)

    def alloc(self, n: int) -> Any:
        import torch

        if self.available_size() < n:
            return None
        ids = [next(self._next) for _ in range(n)]
        self.used.update(ids)
        return torch.tensor(ids, dtype=torch.int64)

    def free(self, indices: Any, *_: Any, **__: Any) -> None:
        for i in indices.tolist():
            self.used.discard(int(i))

    def clear(self) -> None:
        self.used.clear()


class StubTransferController:
    """Stands in for ``HybridCacheController`` (SGLang 0.5.23): the calls the unified cache makes on
    the device<->host path, with finished acks and no data."""

    enable_storage = False
    pp_prefetch_command_group = None
    transfer_layer_id_max = 0

    def __init__(self, write_policy: str, host_tokens: int, device_allocator: Any) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; expected one of {WRITE_POLICIES}")
        self.write_policy = write_policy
        self.host = StubHostPool(host_tokens)
        self.mem_pool_host = types.SimpleNamespace(
            anchor_entry=types.SimpleNamespace(host_pool=self.host, host_evict_fn=None),
            available_size=self.host.available_size, free=self.host.free, clear=self.host.clear)
        self.ack_write_queue: list[_Ack] = []
        self.ack_load_queue: list[_Ack] = []
        self.device_allocator = device_allocator
        self.loads: list[int] = []  # tokens per load the cache asked for (what it decided to load back)

    def write(self, device_indices: Any, priority: Any = None, node_id: int = -1, extra_pools: Any = None,
              flush: bool = True, **_: Any) -> Any:
        host = self.host.alloc(len(device_indices))
        if host is not None:
            self.ack_write_queue.append(_Ack([node_id]))
        return host

    def load(self, host_indices: Any, priority: Any = None, node_id: int = -1, extra_pools: Any = None, **_: Any) -> Any:
        """``HybridCacheController.load``: device slots from the device allocator, None when it is full."""
        device_indices = self.device_allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.loads.append(len(host_indices))
        self.ack_load_queue.append(_Ack([node_id]))
        return device_indices

    def start_writing(self) -> None:
        pass

    def start_loading(self) -> int:
        return 0

    def reset(self) -> None:
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()

    def register_host_pool_entry(self, entry: Any) -> None:
        pass


class _HostPoolGroup:
    def __init__(self, host: StubHostPool) -> None:
        self.host = host
        self.entry_map: dict[Any, Any] = {}

    def free(self, indices: Any, *_: Any, **__: Any) -> None:
        self.host.free(indices)

    def release_transfers(self, *_: Any, **__: Any) -> None:
        pass

    def get_pool(self, _name: Any) -> None:
        return None

    def destroy(self) -> None:
        pass


@contextmanager
def _stub_pools(controller: StubTransferController) -> Iterator[None]:
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as assembler

    def attach(cache: Any, *_: Any, **__: Any) -> None:  # _apply_stack_result's two assignments
        cache.host_pool_group = _HostPoolGroup(controller.host)
        cache.cache_controller = controller

    saved = assembler.attach_hybrid_pool_to_unified_cache
    assembler.attach_hybrid_pool_to_unified_cache = attach
    try:
        yield
    finally:
        assembler.attach_hybrid_pool_to_unified_cache = saved


def attach_host_tier(cache: Any, write_policy: str, host_tokens: int, sglang_version: str) -> StubTransferController:
    """Turn the host tier of a real ``UnifiedRadixCache`` on through its own ``init_hicache``.

    Call it inside the scheduler's context (``use_context(scheduler_context(...))``); the cache's
    ``token_to_kv_pool_allocator`` is the device allocator that loads allocate from."""
    problem = version_problem(sglang_version)
    if problem:
        raise OracleUnavailable(problem)
    controller = StubTransferController(write_policy, host_tokens, cache.token_to_kv_pool_allocator)
    if not hasattr(cache, "metrics_collector"):
        cache.metrics_collector = None
    with _stub_pools(controller):
        cache.init_hicache(types.SimpleNamespace(file_storage_path=None), None)
    atexit.unregister(cache.shutdown)  # init_hicache registers it for the storage backend there is none of
    return controller
