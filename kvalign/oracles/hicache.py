"""SGLang's real ``UnifiedRadixCache`` with its host tier (HiCache) on, as the ``tier`` property drives it.

The cache, its tree core and every tiering decision are SGLang's; only the device<->host transfer
path is stood in (:mod:`kvalign.standins.hicache`, pinned to the SGLang release it was written for).
The operations are the scheduler's entry points for one worker: cache a finished request
(``insert``), poll transfer completions (``writing_check`` / ``loading_check``), device eviction,
host eviction, admit a request (``match_prefix``, then ``init_load_back`` when part of its prefix is
on host only, as ``schedule_policy`` does), and a cache flush (``reset``).
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.sglang import SglangRadixCache, sglang_version

#: The unified cache's tree cores: ``unified`` = the server default (Rust on 0.5.23), ``unified-python``.
CORES = ("unified", "unified-python")


@dataclass(frozen=True)
class Residency:
    """Where SGLang holds a prompt's prefix, in pages: on device, then on host only beyond that."""

    device: int
    host: int


def available_cores() -> tuple[str, ...]:
    """The tree cores this SGLang can select (both where ``tree_core_backend`` exists)."""
    from kvalign.oracles.sglang import _modules

    return CORES if "tree_core_backend" in _modules().fields else CORES[:1]


class HiCacheEngine:
    """One real ``UnifiedRadixCache`` with HiCache on (write policy ``policy``, ``host_tokens`` host slots)."""

    _rids = itertools.count()

    def __init__(self, page_size: int, *, eagle: bool, core: str, policy: str, host_tokens: int,
                 dynamo_format: bool = False) -> None:
        from kvalign.standins.hicache import attach_host_tier

        if core not in CORES:
            raise ValueError(f"the host tier needs the unified cache; got {core!r}")
        self.page_size, self.eagle, self.policy = page_size, eagle, policy
        self._o = SglangRadixCache(page_size, eagle=eagle, kind=core, dynamo_format=dynamo_format)
        self.cache = self._o._cache
        if not hasattr(self.cache, "init_hicache"):
            raise OracleUnavailable(f"SGLang {sglang_version()}'s {type(self.cache).__name__} has no init_hicache")
        self.controller = attach_host_tier(self.cache, policy, host_tokens, sglang_version())
        self._m = self._o._m

    @property
    def core(self) -> str:
        return self._o.core

    @property
    def load_back_threshold(self) -> int:
        """Set by SGLang's own ``init_hicache`` (10 tokens in 0.5.23), read back from the cache."""
        return int(self.cache.load_back_threshold)

    def insert(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None) -> None:
        self._o.insert(tokens, lora_name=lora_name, cache_salt=cache_salt)

    def transfers_done(self) -> None:
        """The scheduler's per-step poll: finished backups and load-backs are committed."""
        self.cache.writing_check()
        self.cache.loading_check()

    def evict(self, num_tokens: int) -> None:
        self._o.evict(num_tokens)

    def evict_host(self, num_tokens: int) -> None:
        self.cache.evict_host(num_tokens)

    def reset(self) -> None:
        self.cache.reset()

    def _match(self, tokens: Sequence[int], lora_name: str | None, cache_salt: str | None) -> Any:
        return self.cache.match_prefix(self._m.bpc.MatchPrefixParams(key=self._o._key(tokens, lora_name, cache_salt)))

    def residency(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None) -> Residency:
        r = self._match(tokens, lora_name, cache_salt)
        return Residency(int(r.device_prefix_len) // self.page_size, int(r.host_hit_length) // self.page_size)

    def admit(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None) -> tuple[int, int]:
        """Admit a request as the scheduler does: match, then ``init_load_back`` when a host-only
        stretch follows the device prefix, then poll the load to completion.

        Returns (host-only units matched, units SGLang loaded back): loaded < matched means SGLang
        declined the load-back and re-prefills that stretch.
        """
        r = self._match(tokens, lora_name, cache_salt)
        host = int(r.host_hit_length)
        if host == 0:
            return 0, 0
        req = types.SimpleNamespace(rid=f"kvalign-{next(self._rids)}", kv=types.SimpleNamespace(mamba_pool_idx=None),
                                    last_node=r.last_device_node, swa_host_hit_length=0, mamba_host_hit_length=0)
        loaded, _node = self.cache.init_load_back(self._m.bpc.InitLoadBackParams(
            best_match_node=r.best_match_node, host_hit_length=host, req=req))
        self.cache.loading_check()
        return host, int(loaded)

    def take_raw_events(self) -> list[Any]:
        return self._o.take_raw_events()
