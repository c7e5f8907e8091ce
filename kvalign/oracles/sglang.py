"""The real SGLang radix cache on CPU, as an :class:`~kvalign.oracles.base.EngineCache`.

kvalign's claims about what SGLang stores are only worth something if they are checked against
SGLang's own code, so this oracle drives the very classes the server builds: the serving default
``UnifiedRadixCache(FULL)`` (Rust tree core on 0.5.23, Python core on 0.5.19) and the plain
``RadixCache``. SGLang needs no GPU for this; it needs torch (CPU) and one import shim for
torchvision, installed by ``scripts/setup.sh``.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.metadata
import os
import sys
import types
import uuid
import warnings
from array import array
from collections.abc import Sequence
from functools import cache
from typing import Any

from kvalign.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvalign.oracles.base import OracleUnavailable

KINDS = ("unified", "unified-python", "radix")


@cache
def sglang_version() -> str:
    """Installed sglang version, or :class:`OracleUnavailable` with what to install."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise OracleUnavailable(
            "sglang is not installed: run scripts/setup.sh (torch CPU first, then sglang --no-deps)"
        ) from None


def torch_extensions_dir(version: str | None = None) -> str:
    """One JIT build of SGLang's event-hash extension per venv and SGLang version (the sources
    differ between versions but the extension name does not); real-engine workers share it.
    ``version``: a release the workers run from the wheel cache (default: the importable one)."""
    return os.path.join(sys.prefix, "torch-extensions", f"sglang-{version or sglang_version()}")


@cache
def shutdown_publisher(publisher: Any) -> None:
    """Stop one SGLang ``ZmqEventPublisher`` for good.

    SGLang registers ``shutdown`` with :mod:`atexit` too, and its shutdown is not idempotent: the
    second call enqueues a stop sentinel that no thread will consume, waits its 1 s timeout and
    logs "Warning: Queue still has 1 items" at interpreter exit, after an ALIGNED verdict. So the
    hook is unregistered once kvalign has stopped the publisher itself.
    """
    publisher.shutdown()
    atexit.unregister(publisher.shutdown)


def _modules() -> types.SimpleNamespace:
    """Import SGLang's cache classes once, behind the torchvision shim.

    PyPI torchvision is a CUDA build; its two op-registration modules fail beside torch+cpu
    ("operator torchvision::nms does not exist"). Pre-seeding them lets the rest import.
    """
    sglang_version()
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", torch_extensions_dir())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
            from sglang.srt.mem_cache import base_prefix_cache as bpc
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
            from sglang.srt.mem_cache.unified_cache.components import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    except Exception as exc:  # an import chain this long fails in many ways; report the root
        raise OracleUnavailable(f"cannot import SGLang's radix cache ({type(exc).__name__}: {exc})") from None
    fields = {f.name for f in dataclasses.fields(CacheInitParams)}
    return types.SimpleNamespace(
        torch=torch, bpc=bpc, CacheInitParams=CacheInitParams, RadixCache=RadixCache, RadixKey=RadixKey,
        ComponentType=ComponentType, UnifiedRadixCache=UnifiedRadixCache, fields=fields,
    )


class _CpuAllocator:
    """Stands in for the KV pool allocator: the cache only hands slot ids back to it."""

    device = "cpu"

    def free(self, indices: Any) -> None:
        pass

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        pass

    def free_segments(self, segments: Any) -> None:
        pass


def lora_id_for(lora_name: str) -> str:
    """A stable 32-hex LoRA id for a name (SGLang appends the id to ``extra_key``)."""
    return uuid.uuid5(uuid.NAMESPACE_URL, "kvalign-lora:" + lora_name).hex


def _metadata_salt(metadata: Any) -> str | None:
    """``cache_salt`` from an event's metadata: a map (0.5.23) or a ``BlockStoredMetadata`` struct (0.5.19)."""
    if metadata is None:
        return None
    if isinstance(metadata, dict):
        return metadata.get("cache_salt")
    return getattr(metadata, "cache_salt", None)


def to_kvalign_event(ev: Any) -> KVEvent:
    """Convert one of SGLang's in-process event objects (any version's structs) to kvalign's model."""
    name = type(ev).__name__
    if name.startswith("BlockStored"):
        tokens = [tuple(int(x) for x in t) if isinstance(t, (tuple, list)) else int(t) for t in ev.token_ids]
        return BlockStored(
            block_hashes=[int(h) for h in ev.block_hashes],
            parent_block_hash=None if ev.parent_block_hash is None else int(ev.parent_block_hash),
            token_ids=tokens,
            block_size=int(ev.block_size),
            lora_id=ev.lora_id,
            medium=getattr(ev.medium, "value", ev.medium),
            cache_salt=getattr(ev, "cache_salt", None) or _metadata_salt(getattr(ev, "metadata", None)),
            lora_name=getattr(ev, "lora_name", None),
            session_id=getattr(ev, "session_id", None),
        )
    if name == "BlockRemoved":
        return BlockRemoved([int(h) for h in ev.block_hashes], getattr(ev.medium, "value", ev.medium))
    if name == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown SGLang event type {name}")


class SglangRadixCache:
    """One real SGLang prefix cache with KV events enabled.

    ``kind``: ``"unified"`` (the server default, whatever core this version defaults to),
    ``"unified-python"`` (force the Python core where selectable) or ``"radix"``.
    """

    def __init__(self, page_size: int, *, eagle: bool, kind: str = "unified", dynamo_format: bool = False):
        if kind not in KINDS:
            raise ValueError(f"unknown SGLang cache kind {kind!r}; expected one of {KINDS}")
        m = _modules()
        self.page_size, self.eagle, self.kind = page_size, eagle, kind
        self._m = m
        kw: dict[str, Any] = dict(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=_CpuAllocator(),
            page_size=page_size, is_eagle=eagle, enable_kv_cache_events=True,
        )
        if dynamo_format:
            if "dynamo_kv_event_format" not in m.fields:
                raise OracleUnavailable(f"sglang {sglang_version()} has no dynamo KV-event format")
            kw["dynamo_kv_event_format"] = True
        self._lora_names = None
        if "kv_event_lora_names" in m.fields:
            from sglang.srt.mem_cache.events import KvEventLoraNames

            self._lora_names = kw["kv_event_lora_names"] = KvEventLoraNames()
        if kind == "radix":
            self._cache = m.RadixCache(m.CacheInitParams(**kw))
        else:
            if kind == "unified-python" and "tree_core_backend" in m.fields:
                kw["tree_core_backend"] = "python"
            self._cache = m.UnifiedRadixCache(m.CacheInitParams(tree_components=(m.ComponentType.FULL,), **kw))
        self._next_slot = 0
        self.take_events()  # construction queues one AllBlocksCleared

    @property
    def names_lora_in_events(self) -> bool:
        """Whether this SGLang's events carry the LoRA *name* the router hashes (0.5.23: yes; 0.5.19: no)."""
        return self._lora_names is not None

    @property
    def core(self) -> str:
        """The tree core actually in use (e.g. ``RustUnifiedTreeCore``), for reports."""
        core = getattr(self._cache, "tree_core", None)
        return type(core).__name__ if core is not None else type(self._cache).__name__

    def _key(self, tokens: Sequence[int], lora_name: str | None, cache_salt: str | None) -> Any:
        extra_key = None
        if lora_name:
            lora_id = lora_id_for(lora_name)
            extra_key = lora_id
            if self._lora_names is not None:
                req = types.SimpleNamespace(lora_id=lora_id, extra_key=extra_key)
                self._lora_names.register(req, lora_name)
        return self._m.RadixKey(array("q", [int(t) for t in tokens]), extra_key, cache_salt=cache_salt or None)

    def insert(self, tokens: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None) -> int:
        """Cache a finished request's tokens; returns the prefix length that was already cached."""
        torch = self._m.torch
        value = torch.arange(self._next_slot, self._next_slot + len(tokens), dtype=torch.int64)
        self._next_slot += len(tokens)
        res = self._cache.insert(self._m.bpc.InsertParams(key=self._key(tokens, lora_name, cache_salt), value=value))
        return int(res.prefix_len)

    def match(self, tokens: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None) -> int:
        """Matched units (tokens, or bigrams under EAGLE) = KV slots SGLang would reuse."""
        m = self._cache.match_prefix(self._m.bpc.MatchPrefixParams(key=self._key(tokens, lora_name, cache_salt)))
        if hasattr(m, "device_prefix_len"):
            return int(m.device_prefix_len)
        return len(m.device_indices)

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` slots (whole unlocked leaves); returns slots evicted."""
        res = self._cache.evict(self._m.bpc.EvictParams(num_tokens=num_tokens))
        return int(getattr(res, "num_tokens_evicted", 0) or 0)

    def reset(self) -> None:
        """Drop the whole cache with SGLang's own ``reset``, as the scheduler's ``flush_cache``
        does; SGLang queues one ``AllBlocksCleared`` for it (drain it with :meth:`take_raw_events`)."""
        self._cache.reset()

    def take_events(self) -> list[KVEvent]:
        """Drain the cache's pending KV events, converted to kvalign's event model."""
        take = getattr(self._cache, "take_events", None) or self._cache.kv_events.take
        return [to_kvalign_event(e) for e in take()]

    def take_raw_events(self) -> list[Any]:
        """Drain pending events as SGLang's own objects (for its real ZMQ publisher)."""
        take = getattr(self._cache, "take_events", None) or self._cache.kv_events.take
        return list(take())
