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
import inspect
import os
import sys
import types
import uuid
import warnings
from array import array
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any

from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvalign.oracles.base import OracleUnavailable

#: ``default`` is whichever of the others the release's server builds (:func:`server_default_kind`).
KINDS = ("default", "unified", "unified-python", "radix")


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


def shutdown_publishers(publishers: Iterable[Any]) -> None:
    """:func:`shutdown_publisher` for each, at once: SGLang's shutdown sleeps 0.1 s for its queue to
    drain, so nine publishers stopped one after the other took 0.9 s."""
    from concurrent.futures import ThreadPoolExecutor

    publishers = list(publishers)
    with ThreadPoolExecutor(max(1, len(publishers))) as pool:
        list(pool.map(shutdown_publisher, publishers))


def _seed_host_transfer_ops() -> None:
    """Let ``radix_cache`` import where ``sgl_kernel`` (CUDA only) is absent, as in SGLang 0.5.9.

    0.5.9's ``radix_cache`` imports ``hicache_storage``, which imports ``memory_pool_host``, which
    imports ``sgl_kernel.kvcacheio``'s host <-> device copy ops at module level. ``RadixCache``
    never calls them; every name here raises if anything does, so no copy is faked.
    """

    def op(name: str) -> Any:
        if name.startswith("__"):  # module protocol (__file__, __spec__, ...): absent, as on any module
            raise AttributeError(name)

        def unavailable(*_args: Any, **_kwargs: Any) -> Any:
            raise RuntimeError(f"sgl_kernel.kvcacheio.{name} is CUDA only; kvalign's radix-cache oracle never calls it")
        return unavailable

    package = types.ModuleType("sgl_kernel")
    package.__path__ = []
    kvcacheio = types.ModuleType("sgl_kernel.kvcacheio")
    kvcacheio.__getattr__ = op  # type: ignore[attr-defined]
    package.kvcacheio = kvcacheio  # type: ignore[attr-defined]
    sys.modules["sgl_kernel"], sys.modules["sgl_kernel.kvcacheio"] = package, kvcacheio


@cache
def _modules() -> types.SimpleNamespace:
    """Import SGLang's cache classes once, behind the torchvision shim (cached: every cache built asks).

    PyPI torchvision is a CUDA build; its two op-registration modules fail beside torch+cpu
    ("operator torchvision::nms does not exist"). Pre-seeding them lets the rest import.

    ``RadixCache`` is required; ``UnifiedRadixCache`` is not: releases before the
    ``mem_cache.unified_cache`` package (Dynamo 1.3.1's 0.5.14, 1.0.x's 0.5.9) serve from
    ``RadixCache`` and are checked on it, so its absence is recorded (``unified_missing``), not raised.
    """
    sglang_version()
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", torch_extensions_dir())
    for attempt in range(2):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import torch
                from sglang.srt.mem_cache import base_prefix_cache as bpc
                from sglang.srt.mem_cache.cache_init_params import CacheInitParams
                from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
            break
        except ModuleNotFoundError as exc:
            if attempt or exc.name != "sgl_kernel" or "sgl_kernel" in sys.modules:
                raise OracleUnavailable(f"cannot import SGLang's radix cache ({type(exc).__name__}: {exc})") from None
            _seed_host_transfer_ops()
        except Exception as exc:  # an import chain this long fails in many ways; report the root
            raise OracleUnavailable(f"cannot import SGLang's radix cache ({type(exc).__name__}: {exc})") from None
    component_type = unified = unified_missing = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.srt.mem_cache.unified_cache.components import ComponentType as component_type
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache as unified
    except ImportError as exc:
        unified_missing = f"{type(exc).__name__}: {exc}"
    fields = {f.name for f in dataclasses.fields(CacheInitParams)}
    return types.SimpleNamespace(
        torch=torch, bpc=bpc, CacheInitParams=CacheInitParams, RadixCache=RadixCache, RadixKey=RadixKey,
        ComponentType=component_type, UnifiedRadixCache=unified, unified_missing=unified_missing, fields=fields,
        key_has_salt="cache_salt" in inspect.signature(RadixKey.__init__).parameters,
    )


def has_dynamo_format() -> bool:
    """Whether this SGLang has ``KVEventsConfig.format = "dynamo"`` (0.5.23: ``CacheInitParams.dynamo_kv_event_format``)."""
    return "dynamo_kv_event_format" in _modules().fields


def server_default_kind() -> str:
    """The cache class this SGLang's server builds by default: ``unified`` or ``radix``.

    ``UnifiedRadixCache`` became the default with the ``mem_cache.unified_cache`` package: 0.5.19
    and 0.5.21 deprecate the opt-in ``SGLANG_ENABLE_UNIFIED_RADIX_TREE`` ("the unified radix tree is
    the default tree cache now"), 0.5.23 drops it. Before it, 0.5.14's registry builds
    ``UnifiedRadixCache`` only behind that opt-in (``EnvBool(False)``), as 0.5.16's does, and 0.5.9 has
    no unified cache: they serve from ``RadixCache``, which is what a deployment of them runs. (Read
    in 0.5.9, 0.5.14, 0.5.16, 0.5.19, 0.5.21 and 0.5.23; 0.5.17 and 0.5.18 were not read.)
    """
    return "radix" if _modules().UnifiedRadixCache is None else "unified"


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


def request_key(tokens: Sequence[int], lora_name: str | None, cache_salt: str | None, lora_names: Any) -> Any:
    """The ``RadixKey`` SGLang's scheduler builds for a request of this tenant on a release whose key has a
    ``cache_salt`` (0.5.19+): ``extra_key`` the LoRA id, the name recorded in ``lora_names`` as admission
    does (``_record_kv_event_lora_name``), so that its events carry it."""
    m = _modules()
    extra_key = None
    if lora_name:
        extra_key = lora_id_for(lora_name)
        lora_names.register(types.SimpleNamespace(lora_id=extra_key, extra_key=extra_key), lora_name)
    return m.RadixKey(array("q", [int(t) for t in tokens]), extra_key, cache_salt=cache_salt or None)


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

    ``kind``: ``"default"`` (the class this release's server builds: :func:`server_default_kind`),
    ``"unified"`` (``UnifiedRadixCache``, whatever core this version defaults to), ``"unified-python"``
    (force the Python core where selectable) or ``"radix"``. :attr:`kind` is the class actually built.
    """

    def __init__(self, page_size: int, *, eagle: bool, kind: str = "default", dynamo_format: bool = False,
                 allocator: Any = None, req_to_token_pool: Any = None):
        """``allocator`` / ``req_to_token_pool``: SGLang's own pools, for a cache that a scheduler drives
        (:mod:`kvalign.oracles.admission`); by default the cache only hands slot ids back."""
        if kind not in KINDS:
            raise ValueError(f"unknown SGLang cache kind {kind!r}; expected one of {KINDS}")
        m = _modules()
        if kind == "default":
            kind = server_default_kind()
        elif kind != "radix" and m.UnifiedRadixCache is None:
            raise OracleUnavailable(f"sglang {sglang_version()} has no unified radix cache ({m.unified_missing}); "
                                    "its server builds RadixCache: use --cache radix or the default")
        self.page_size, self.eagle, self.kind = page_size, eagle, kind
        #: the "dynamo" KV-event format: every event hash namespaced by (extra_key, cache_salt), and the
        #: LoRA name resolved with the adapter-id fallback (SGLang 0.5.23's ``KVEventsConfig.format``)
        self.dynamo_format = dynamo_format
        #: LoRA names whose requests reach the scheduler without the name (``recv_req.lora_name`` None, as
        #: from "older IPC senders"): SGLang knows them only from the adapter table (:meth:`load_adapter`)
        self.unnamed_requests: set[str] = set()
        self._m = m
        kw: dict[str, Any] = dict(
            disable=False, req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=_CpuAllocator() if allocator is None else allocator,
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

    @property
    def salts_event_hashes(self) -> bool:
        """Whether a ``cache_salt`` reaches this SGLang's event hashes and events (0.5.19+: a salted
        chain and the salt in the event's metadata). Before ``RadixKey`` had a ``cache_salt``
        (0.5.9, 0.5.14), the OpenAI server folds the salt into ``extra_key``: the radix tree keeps
        tenants apart, but their events are identical, with no salt and the same block hashes."""
        return self._m.key_has_salt

    def _key(self, tokens: Sequence[int], lora_name: str | None, cache_salt: str | None) -> Any:
        """The ``RadixKey`` SGLang's server builds for a request of this tenant.

        ``extra_key`` is what ``Req.__init__`` makes of the request's: the serving layer's
        ``extra_key`` (the ``cache_salt`` itself where ``RadixKey`` has no salt of its own, as
        ``_compute_extra_key`` does there), then the LoRA id appended.
        """
        salt = cache_salt or None
        extra_key = None if self._m.key_has_salt else salt
        if lora_name:
            lora_id = lora_id_for(lora_name)
            extra_key = (extra_key or "") + lora_id
            if self._lora_names is not None:  # the scheduler's admission (_record_kv_event_lora_name)
                req = types.SimpleNamespace(lora_id=lora_id, extra_key=extra_key)
                self._lora_names.register(req, None if lora_name in self.unnamed_requests else lora_name)
        tokens_array = array("q", [int(t) for t in tokens])
        if self._m.key_has_salt:
            return self._m.RadixKey(tokens_array, extra_key, cache_salt=salt)
        return self._m.RadixKey(tokens_array, extra_key)

    def load_adapter(self, lora_name: str) -> None:
        """SGLang's scheduler loading an adapter (``load_lora_adapter``; ``--lora-paths`` at start-up goes
        through ``KvEventLoraNames.from_lora_refs`` to the same table): its id -> name, kept for life."""
        if self._lora_names is None:
            raise OracleUnavailable(f"sglang {sglang_version()} has no KV-event LoRA name table")
        self._lora_names.register(lora_id=lora_id_for(lora_name), lora_name=lora_name)

    def insert(self, tokens: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None) -> int:
        """Cache a finished request's tokens; returns the prefix length that was already cached.

        Only whole pages are inserted, as ``cache_finished_req`` does before it calls ``insert``:
        0.5.9's ``RadixCache.insert`` itself keeps a trailing partial page (and publishes it), later
        releases drop it inside ``insert``.
        """
        units = len(tokens) - 1 if self.eagle else len(tokens)
        whole = max(units, 0) // self.page_size * self.page_size
        if not whole:
            return 0
        tokens = list(tokens[: whole + 1 if self.eagle else whole])
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
