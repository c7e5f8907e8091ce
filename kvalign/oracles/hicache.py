"""SGLang's real ``UnifiedRadixCache`` with its host tier (HiCache) on, driven by SGLang's own scheduler code.

The cache, its tree core, every tiering decision, the device allocator (SGLang's own, bounded: it
runs out, and SGLang's eviction on allocation runs) and the admission of each request
(:mod:`kvalign.oracles.admission`: the scheduler's prefix cap, its prefill admission with the
load-back decision, its prefill allocation and the caching of a finished request) are SGLang's;
only the device<->host transfer path (:mod:`kvalign.standins.hicache`) and a scheduler process's
config and model config (:mod:`kvalign.standins.scheduler`) stand in, pinned to the SGLang release
they were written for. The operations are one worker's: serve a request, poll transfer completions
(``writing_check`` / ``loading_check``), evict device pages, evict host pages, flush the cache
(``flush_cache``: ``reset`` and the pools cleared).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvalign.oracles.admission import Admission, Scheduler, device_allocator, req_to_token_pool
from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.sglang import SglangRadixCache, _modules, sglang_version

#: The unified cache's tree cores: ``unified`` = the server default (Rust on 0.5.23), ``unified-python``.
CORES = ("unified", "unified-python")
#: Device KV slots when none are named: more than any tier-machine example fills (no pressure).
UNBOUNDED_DEVICE_TOKENS = 1 << 16


@dataclass(frozen=True)
class Residency:
    """Where SGLang's tree holds a prompt's prefix, in pages: on device, then on host only beyond that.

    What the tree *holds* (``match_prefix`` of the whole prompt: the pages the router indexes), not
    what a request for the prompt reuses: the scheduler caps that below the prompt's last token
    (:class:`~kvalign.oracles.admission.Admission`)."""

    device: int
    host: int


def available_cores() -> tuple[str, ...]:
    """The tree cores this SGLang can select (both where ``tree_core_backend`` exists)."""
    return CORES if "tree_core_backend" in _modules().fields else CORES[:1]


class HiCacheEngine:
    """One real ``UnifiedRadixCache`` with HiCache on (write policy ``policy``, ``host_tokens`` host
    slots, ``device_tokens`` device slots in SGLang's own allocator), served by SGLang's scheduler code."""

    def __init__(self, page_size: int, *, eagle: bool, core: str, policy: str, host_tokens: int,
                 device_tokens: int | None = None, dynamo_format: bool = False) -> None:
        from kvalign.standins.hicache import attach_host_tier, version_problem
        from kvalign.standins.scheduler import scheduler_context

        if core not in CORES:
            raise ValueError(f"the host tier needs the unified cache; got {core!r}")
        problem = version_problem(sglang_version())
        if problem:
            raise OracleUnavailable(problem)
        self.page_size, self.eagle, self.policy = page_size, eagle, policy
        self.device_tokens = device_tokens or UNBOUNDED_DEVICE_TOKENS
        _modules()  # SGLang's import shims, before its scheduler modules
        self.allocator = device_allocator(page_size, self.device_tokens)
        self.pool = req_to_token_pool()
        self._o = SglangRadixCache(page_size, eagle=eagle, kind=core, allocator=self.allocator,
                                   req_to_token_pool=self.pool, dynamo_format=dynamo_format)
        self.cache = self._o._cache
        if not hasattr(self.cache, "init_hicache"):
            raise OracleUnavailable(f"SGLang {sglang_version()}'s {type(self.cache).__name__} has no init_hicache")
        self.scheduler = Scheduler(self.cache, self.allocator, self.pool, page_size, eagle,
                                   scheduler_context(page_size, policy), self._o._lora_names)
        with self.scheduler.sglang():
            self.controller = attach_host_tier(self.cache, policy, host_tokens, sglang_version())
        self._m = self._o._m

    @property
    def core(self) -> str:
        return self._o.core

    @property
    def load_back_threshold(self) -> int:
        """Set by SGLang's own ``init_hicache`` (10 tokens in 0.5.23), read back from the cache."""
        return int(self.cache.load_back_threshold)

    def serve(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None,
              logprob_start_len: int | None = None) -> Admission:
        """A request arrives and is admitted, prefilled and finished by SGLang's scheduler code (its prompt
        is then cached); what SGLang matched, loaded back and reported (:class:`Admission`)."""
        return self.scheduler.serve(tokens, lora_name, cache_salt, logprob_start_len)

    def transfers_done(self) -> None:
        """The scheduler's per-step poll: finished backups and load-backs are committed."""
        with self.scheduler.sglang():
            self.cache.writing_check()
            self.cache.loading_check()

    def evict(self, num_tokens: int) -> None:
        """Device pressure from outside this worker's requests: SGLang's own ``evict``."""
        with self.scheduler.sglang():
            self._o.evict(num_tokens)

    def evict_host(self, num_tokens: int) -> None:
        with self.scheduler.sglang():
            self.cache.evict_host(num_tokens)

    def reset(self) -> None:
        """``Scheduler.flush_cache``: the tree reset, the request and KV pools cleared."""
        with self.scheduler.sglang():
            self.cache.reset()
            self.pool.clear()
            self.allocator.clear()

    def available_tokens(self) -> int:
        """Free device slots in SGLang's allocator."""
        return int(self.allocator.available_size())

    def evictable_tokens(self) -> int:
        """Device slots SGLang's eviction on allocation could free (unlocked cached pages)."""
        return int(self.cache.full_evictable_size())

    def residency(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None) -> Residency:
        """What the tree holds of the whole prompt (no scheduler cap): the pages the router indexes."""
        with self.scheduler.sglang():
            r = self.cache.match_prefix(self._m.bpc.MatchPrefixParams(key=self._o._key(tokens, lora_name, cache_salt)))
        return Residency(int(r.device_prefix_len) // self.page_size, int(r.host_hit_length) // self.page_size)

    def take_raw_events(self) -> list[Any]:
        return self._o.take_raw_events()
