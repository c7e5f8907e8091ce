"""SGLang's real ``UnifiedRadixCache`` with HiCache's storage tier (L3) on the ``file`` backend, on CPU.

Everything on the L1 -> L2 -> L3 -> L2 path is SGLang 0.5.23's own: the cache and its tree core,
``HybridCacheController`` (write-through, storage backup and prefetch threads), the host pool, the
``file`` backend (``HiCacheFile``: one file per page, named by SGLang's SHA-256 page key) and the
events. The pools are built as SGLang's unit-test kit builds a FULL cache
(``sglang/test/kits/unified_radix_cache/fixtures.py``) and HiCache is turned on as its storage
tests do (``mixins.py: _init_hicache(storage_backend="file")``: the ``kernel`` IO backend, a
storage directory, a single-rank topology, ``prefetch_threshold`` in the backend's extra config);
the CUDA-only pieces stand in (:mod:`kvalign.standins.hicache_storage`). A request's refill from
storage is what the scheduler's ``_prefetch_kvcache`` asks: ``prefetch_from_storage`` from the
deepest host-matched node for the rest of the prompt up to its prefix cap (all but the last token),
with the request's ``extra_key`` and ``cache_salt``, pumped (``check_hicache_events``) until
``check_prefetch_progress`` says it is done.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.sglang import _modules, request_key, sglang_version

#: Device and host KV slots (the kit sizes both pools equally).
KV_TOKENS = 512
#: How long one transfer (a storage write, a prefetch) may take before it is a failure.
PUMP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Tiers:
    """Where SGLang holds a prompt's prefix, in pages: on device, on host beyond that, and in storage."""

    device: int
    host: int
    storage: int


class StorageEngine:
    """One worker's cache with HiCache and the ``file`` storage backend (write policy ``write_through``)."""

    def __init__(self, page_size: int, *, eagle: bool, prefetch_threshold: int | None = None,
                 storage_dir: str | None = None) -> None:
        from kvalign.standins.hicache_storage import install, pinned_ranges, release_pinned, version_problem

        problem = version_problem(sglang_version())
        if problem:
            raise OracleUnavailable(problem)
        self._m = _modules()
        install()
        self.page_size, self.eagle = page_size, eagle
        self._own_dir = storage_dir is None
        self.storage_dir = storage_dir or tempfile.mkdtemp(prefix="kvalign-hicache-")
        self._handles = 0
        self._scheduler: Any = None
        before = pinned_ranges()
        self._closers: list[Callable[[], None]] = [lambda: release_pinned(before)]
        try:
            self._build(prefetch_threshold or page_size)
        except OracleUnavailable:
            self.close()
            raise
        except Exception as exc:  # SGLang's storage path did not start on this machine: say where
            self.close()
            raise OracleUnavailable(f"SGLang {sglang_version()}'s HiCache storage (file backend) cannot start here: "
                                    f"{type(exc).__name__}: {exc}") from None
        self.take_raw_events()

    def _build(self, prefetch_threshold: int) -> None:
        import torch
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.events import KvEventLoraNames
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        p = self.page_size
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=p))
        self.pool = ReqToTokenPool(size=10, max_context_len=512, device="cpu", enable_memory_saver=False)
        self.kv = MHATokenToKVPool(size=KV_TOKENS, page_size=p, dtype=torch.bfloat16, head_num=2, head_dim=64,
                                   layer_num=4, device="cpu", enable_memory_saver=False)
        # the allocator SGLang's model runner picks for the page size (the scheduler's extend needs the paged one)
        self.allocator = (PagedTokenToKVPoolAllocator(size=KV_TOKENS, page_size=p, dtype=torch.bfloat16, device="cpu",
                                                      kvcache=self.kv, need_sort=False) if p > 1 else
                          TokenToKVPoolAllocator(size=KV_TOKENS, dtype=torch.bfloat16, device="cpu", kvcache=self.kv,
                                                 need_sort=False))
        self.lora_names = KvEventLoraNames()
        params = CacheInitParams(req_to_token_pool=self.pool, token_to_kv_pool_allocator=self.allocator, page_size=p,
                                 disable=False, tree_components=(ComponentType.FULL,), enable_kv_cache_events=True,
                                 kv_event_lora_names=self.lora_names, is_eagle=self.eagle)
        self.cache = UnifiedRadixCache(params=params)
        for ctx in (get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1),
                    envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(self.storage_dir)):
            ctx.__enter__()
            self._closers.insert(0, lambda c=ctx: c.__exit__(None, None, None))
        args = ServerArgs(model_path="dummy", page_size=p, hicache_io_backend="kernel", hicache_write_policy="write_through",
                          hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
                          hicache_storage_backend_extra_config=json.dumps({"prefetch_threshold": prefetch_threshold}))
        set_global_server_args_for_scheduler(args)
        self.cache.init_hicache(args, params)
        import atexit

        atexit.unregister(self.cache.shutdown)
        controller = self.cache.cache_controller
        # stop the storage threads, then give the host pool back (its pinned ranges are unregistered, as
        # the kit's cleanup does: a later engine's pool can land on the same addresses)
        self._closers[:0] = [controller._stop_storage_threads, self.cache.release_host_resources]
        if not controller.enable_storage:
            raise OracleUnavailable("SGLang's HiCache controller started without its storage backend")
        self.backend = controller.storage_backend
        self.prefetch_threshold = prefetch_threshold

    # -- requests and the scheduler's poll -------------------------------------------------
    def _key(self, tokens: Sequence[int], lora_name: str | None, cache_salt: str | None) -> Any:
        return request_key(tokens, lora_name, cache_salt, self.lora_names)

    def insert(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None) -> None:
        """A finished request's whole pages cached (their KV filled with a marker, so refills move bytes)."""
        whole = max(len(tokens) - self.eagle, 0) // self.page_size * self.page_size
        if not whole:
            return
        tokens = list(tokens[: whole + self.eagle])
        key = self._key(tokens, lora_name, cache_salt)
        value = self.allocator.alloc(len(key))
        if value is None:
            raise OracleUnavailable(f"the storage engine's {KV_TOKENS} device slots ran out")
        self.kv.get_key_buffer(self.kv.start_layer)[value] = float(tokens[0] % 64)
        self.cache.insert(self._m.bpc.InsertParams(key=key, value=value))

    def pump(self, until: Callable[[], bool] | None = None) -> bool:
        """The scheduler's per-step poll (``check_hicache_events``, the storage control queues) until
        ``until`` holds (or, without one, until no storage write is in flight)."""
        done = until or (lambda: not self.cache.ongoing_backup)
        deadline = time.monotonic() + PUMP_TIMEOUT_S
        while True:
            self.cache.check_hicache_events()
            self.cache.drain_storage_control_queues()
            if done():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def evict(self, num_tokens: int) -> int:
        return int(self.cache.evict(self._m.bpc.EvictParams(num_tokens=num_tokens)).num_tokens_evicted)

    def evict_host(self, num_tokens: int) -> int:
        return int(self.cache.evict_host(num_tokens) or 0)

    def refill(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None) -> int:
        """The scheduler's storage prefetch for a request with this prompt; tokens refilled into the host tier."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        key = self._key(tokens, lora_name, cache_salt)
        m = self.cache.match_prefix(self._m.bpc.MatchPrefixParams(key=key))
        matched = int(m.device_prefix_len) + int(m.host_hit_length)
        cap = len(tokens) - 1  # Req._compute_max_prefix_len: the last token is always computed
        if cap <= matched or not (self.cache.is_root(m.last_host_node) or self.cache.is_backuped(m.last_host_node)):
            return 0
        self._handles += 1
        handle = CacheRequestHandle(f"kvalign-{self._handles}", 0)
        self.cache.prefetch_from_storage(handle, m.last_host_node, array("q", [int(t) for t in tokens[matched:cap]]),
                                         self.cache.get_last_hash_value(m.last_host_node), None,
                                         matched_prefix_tokens=[int(t) for t in tokens[:matched]],
                                         extra_key=key.extra_key, cache_salt=key.cache_salt)
        if not self.pump(lambda: self.cache.check_prefetch_progress(handle)):
            raise OracleUnavailable(f"SGLang's storage prefetch did not finish within {PUMP_TIMEOUT_S:.0f} s")
        after = self.cache.match_prefix(self._m.bpc.MatchPrefixParams(key=key))
        return max(0, int(after.device_prefix_len) + int(after.host_hit_length) - matched)

    @property
    def load_back_threshold(self) -> int:
        """Set by SGLang's own ``init_hicache`` (10 tokens in 0.5.23): a shorter host stretch is re-prefilled."""
        return int(self.cache.load_back_threshold)

    def serve(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None) -> Any:
        """The request admitted, prefilled and finished by SGLang's scheduler code
        (:class:`~kvalign.oracles.admission.Scheduler`): its cap, the load-back of the host stretch a refill
        left (declined below :attr:`load_back_threshold`) and ``cached_tokens``, what the engine reuses."""
        if self._scheduler is None:
            from kvalign.oracles.admission import Scheduler
            from kvalign.standins.scheduler import scheduler_context

            self._scheduler = Scheduler(self.cache, self.allocator, self.pool, self.page_size, self.eagle,
                                        scheduler_context(self.page_size, "write_through"), self.lora_names)
        admission = self._scheduler.serve(tokens, lora_name, cache_salt)
        c = self.cache
        c.ready_to_load_host_cache()  # the scheduler starts the batch's load-back before its forward pass
        if not self.pump(lambda: not (c.ongoing_load_back or c.ongoing_write_through or c.ongoing_backup)):
            raise OracleUnavailable(f"SGLang's load-back and write-through did not finish within {PUMP_TIMEOUT_S:.0f} s")
        return admission

    # -- what SGLang holds ------------------------------------------------------------------
    def storage_keys(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None) -> list[str]:
        """SGLang's own storage key of each whole page of the prompt (``get_storage_hash_str``: the
        SHA-256 chain seeded by ``storage_namespace_seed(extra_key, cache_salt)``)."""
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        key = self._key(tokens, lora_name, cache_salt)
        if self.eagle:
            key, _ = key.maybe_to_bigram_view(True)
        n = len(key) // self.page_size * self.page_size
        return list(get_storage_hash_str(key[:n], None, page_size=self.page_size)) if n else []

    def tiers(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None) -> Tiers:
        """Pages of the prompt on device, on host beyond them, and in storage beyond both (leading pages the
        backend holds under SGLang's keys for this tenant)."""
        m = self.cache.match_prefix(self._m.bpc.MatchPrefixParams(key=self._key(tokens, lora_name, cache_salt)))
        device, host = int(m.device_prefix_len) // self.page_size, int(m.host_hit_length) // self.page_size
        keys = self.storage_keys(tokens, lora_name, cache_salt)
        stored = 0
        for k in keys:
            if not self.backend.exists(k):
                break
            stored += 1
        return Tiers(device, host, max(0, stored - device - host))

    def stored_files(self) -> list[str]:
        """The page keys the ``file`` backend wrote (file names without the backend's rank suffix)."""
        import os

        suffix = f"{self.backend.config_suffix}.bin"
        return sorted(n[: -len(suffix)] for n in os.listdir(self.storage_dir) if n.endswith(suffix))

    def take_raw_events(self) -> list[Any]:
        return list(self.cache.take_events())

    def close(self) -> None:
        while self._closers:
            try:
                self._closers.pop(0)()
            except Exception:  # a half-started engine: stop what did start
                pass
        if self._own_dir:
            shutil.rmtree(self.storage_dir, ignore_errors=True)
