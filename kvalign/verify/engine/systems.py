"""The real systems a ``check`` run drives, handed to every property's ``run``.

The router hasher, SGLang's cache factory and Dynamo's index are cheap; the registration code and
the in-process router path cost seconds each and only some properties need them, so they load
lazily and once. :meth:`Systems.for_format` gives a view whose caches publish in another KV-event
format and that shares what was loaded, so a worker running both formats starts one path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvalign.oracles.base import RouterHasher


@dataclass
class Systems:
    """The systems under test; ``registration()`` and ``router_path()`` load on first use."""

    hasher: RouterHasher
    make_cache: Callable[[int, bool], Any]
    make_index: Callable[[], Any]
    load_registration: Callable[[], Any] | None = None
    open_router_path: Callable[[], Any] | None = None
    #: the cache factory for a KV-event format (None: ``make_cache`` whatever the format)
    cache_for: Callable[[str], Callable[[int, bool], Any]] | None = None
    #: what was loaded, shared by every :meth:`for_format` view
    _loaded: dict[str, Any] = field(default_factory=dict)

    def registration(self) -> Any:
        if "registration" not in self._loaded:
            load = self.load_registration
            if load is None:
                from kvalign.oracles.registration import load_registration as load
            self._loaded["registration"] = load()
        return self._loaded["registration"]

    def router_path(self) -> Any:
        if "path" not in self._loaded:
            open_path = self.open_router_path
            if open_path is None:
                from kvalign.oracles.router_path import RouterPath as open_path
            self._loaded["path"] = open_path()
            self._start_range()
        self._loaded["path_job"] = self._loaded.get("job")
        return self._loaded["path"]

    def path_used(self) -> bool:
        """Whether the job under way asked for the router path (its rows ran through the relay and router)."""
        return "path" in self._loaded and self._loaded.get("path_job") == self._loaded.get("job")

    def relay_apart(self) -> Systems:
        """A view whose router path runs each worker's relay in a process of its own
        (:class:`~kvalign.oracles.relay_process.ProcessRouterPath`), as a deployment does. Its path is
        opened on first use and shared by every later view (its relays start once per page size and mode,
        as the in-process path's do); :meth:`close` closes it with this one. The rest (caches, hasher) is
        this view's."""
        from kvalign.oracles.relay_process import ProcessRouterPath

        transform = getattr(self._loaded.get("path"), "transform", None)  # a negative control's broken hop stays
        view = replace(self, open_router_path=lambda: ProcessRouterPath(transform),
                       _loaded=self._loaded.setdefault("apart", {}))
        if "job" in self._loaded:
            view.start_job(self._loaded["job"])
        return view

    def close_apart(self) -> None:
        """Close the shared relay-apart path, so that the next :meth:`relay_apart` view opens a fresh one."""
        apart = self._loaded.get("apart", {}).pop("path", None)
        if apart is not None:
            apart.close()

    def start_job(self, k: int) -> None:
        """The ``k``-th job of the run starts: its examples take the router path's ``k``-th token ranges,
        so what it generates and what the engines then do is the same in any process, after any job."""
        self._loaded["job"] = k
        self._start_range()

    def _start_range(self) -> None:
        path = self._loaded.get("path")
        if path is not None and "job" in self._loaded and hasattr(path, "start_range"):
            path.start_range(self._loaded["job"])

    def for_format(self, event_format: str) -> Systems:
        """A view whose caches publish in ``event_format``, sharing what was loaded."""
        if self.cache_for is None:
            return self
        return replace(self, make_cache=self.cache_for(event_format))

    def close(self) -> None:
        apart = self._loaded.pop("apart", {}).pop("path", None)
        try:
            if apart is not None:
                apart.close()
        finally:
            path = self._loaded.pop("path", None)
            if path is not None:
                path.close()


@dataclass(frozen=True)
class SystemsSpec:
    """What builds a run's systems, picklable (a ``check --jobs`` worker builds its own from it)."""

    #: ``--router-hash MODULE:FUNC``, None for the installed Dynamo binding
    router_hash: str | None = None
    #: ``--cache``: the SGLang cache class asked for
    cache: str = "default"


@dataclass(frozen=True)
class Facts:
    """What the header and the report say of the systems (found by whoever built them)."""

    sglang: str
    dynamo: str
    #: the cache class ``--cache`` resolved to
    kind: str
    #: whether this SGLang has the "dynamo" KV-event format
    dynamo_format: bool


def open_systems(spec: SystemsSpec) -> tuple[Systems, Facts]:
    """Import Dynamo and SGLang, load the router hasher and build one cache (failing fast, with an install
    hint, where they cannot): the systems, and what was found."""
    from kvalign.oracles.dynamo import DynamoRadixTree, dynamo_version, load_router_hasher
    from kvalign.oracles.sglang import SglangRadixCache, has_dynamo_format, sglang_version

    hasher = load_router_hasher(spec.router_hash)
    kind = SglangRadixCache(1, eagle=False, kind=spec.cache).kind

    def cache_for(event_format: str) -> Callable[[int, bool], Any]:
        dynamo_format = event_format == "dynamo"
        return lambda p, eagle: SglangRadixCache(p, eagle=eagle, kind=kind, dynamo_format=dynamo_format)

    facts = Facts(sglang_version(), dynamo_version(), kind, has_dynamo_format())
    return Systems(hasher, cache_for("default"), DynamoRadixTree, cache_for=cache_for), facts
