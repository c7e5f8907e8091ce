"""The real Dynamo KV router (``ai-dynamo-runtime``, runs on CPU) behind kvalign's oracles.

Two pieces are used: the router hasher ``dynamo._core.compute_block_hash_for_seq`` and the
runtime-free ``RadixTree`` the router matches prompts against. A user can substitute any hasher
with the binding's signature (``module:function``) to test a patched router build.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import importlib.metadata
import json
import os
from collections.abc import Sequence
from itertools import count
from typing import Any

from kvalign.oracles.base import OracleUnavailable, RouterHasher
from kvalign.model.relay import RouterCleared, RouterEvent, RouterRemoved, RouterStored


def dynamo_version() -> str:
    try:
        return importlib.metadata.version("ai-dynamo-runtime")
    except importlib.metadata.PackageNotFoundError:
        raise OracleUnavailable(
            "ai-dynamo-runtime is not installed: run scripts/setup.sh "
            "(pip install --no-deps ai-dynamo-runtime==1.6.1 plus its dependencies)"
        ) from None


@functools.cache
def _core() -> Any:
    """``dynamo._core``, looked up once per process: every ``DynamoRadixTree`` asks (one per generated
    example: 1,692 in test_alignment, test_check and test_stateful alone), and the installed-version check
    reads package metadata from disk (0.45 ms a call, 10 times the tree's own construction). A failure is
    not cached: it raises, and the next call tries again."""
    dynamo_version()
    # The Rust core logs every skipped store at WARN; misaligned runs would bury the report.
    os.environ.setdefault("DYN_LOG", "error")
    try:
        return importlib.import_module("dynamo._core")
    except ImportError as exc:
        raise OracleUnavailable(f"cannot import dynamo._core ({exc})") from None


#: Keyword parameters of today's binding that older releases lack (1.0.x: both; 1.3.x: cache_namespace).
OPTIONAL_PARAMS = ("is_eagle", "cache_namespace")


def adapt_hasher(fn: Any) -> RouterHasher:
    """``fn`` with today's six-argument signature, whatever release it comes from.

    A release whose binding lacks ``is_eagle`` or ``cache_namespace`` cannot hash EAGLE windows
    or namespaced blocks at all; the adapter drops the argument (exactly what such a router does)
    so the properties report the consequence as a named cause instead of crashing. The missing
    names are kept on ``.missing`` for the report.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: assume today's
        return fn
    missing = tuple(p for p in OPTIONAL_PARAMS if p not in params)
    if not missing:
        return fn

    def adapted(tokens: Sequence[int], kv_block_size: int, block_mm_infos: Any = None, lora_name: str | None = None,
                is_eagle: bool | None = None, cache_namespace: str | None = None) -> list[int]:
        kw = {k: v for k, v in (("is_eagle", is_eagle), ("cache_namespace", cache_namespace)) if k not in missing}
        return fn(tokens, kv_block_size, block_mm_infos, lora_name, **kw)

    adapted.missing = missing  # type: ignore[attr-defined]
    return adapted


def load_router_hasher(spec: str | None = None) -> RouterHasher:
    """The installed router's hasher (adapted to today's signature), or ``module:function`` for a user's own build."""
    if spec is None:
        return adapt_hasher(_core().compute_block_hash_for_seq)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--router-hash must look like MODULE:FUNCTION, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import router hasher module {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    return fn


class DynamoRadixTree:
    """Dynamo's real ``RadixTree``, fed with router events, answering overlap per worker."""

    def __init__(self) -> None:
        self._tree = _core().RadixTree()
        self._ids = count(1)
        self.rejected: list[str] = []

    def apply(self, worker_id: int, event: RouterEvent) -> None:
        if isinstance(event, RouterStored):
            data: Any = {"stored": {"parent_hash": event.parent_hash,
                                    "blocks": [{"block_hash": e, "tokens_hash": t} for e, t in event.blocks]}}
        elif isinstance(event, RouterRemoved):
            data = {"removed": {"block_hashes": event.block_hashes}}
        elif isinstance(event, RouterCleared):
            data = "cleared"
        else:
            raise TypeError(f"not a router event: {event!r}")
        payload = {"event_id": next(self._ids), "data": data, "dp_rank": 0}
        try:
            self._tree.apply_event(worker_id, json.dumps(payload).encode())
        except RuntimeError as exc:
            # The router's event loop logs such an event and carries on (e.g. removing a block it
            # never indexed because a misaligned store collapsed two blocks into one); so do we.
            self.rejected.append(str(exc))

    def overlap(self, local_hashes: Sequence[int]) -> dict[int, int]:
        scores = self._tree.find_matches(list(local_hashes)).scores
        return {w: n for (w, _dp), n in scores.items() if n}
