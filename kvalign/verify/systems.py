"""The real systems a ``check`` run drives, handed to every property's ``run``.

The router hasher, SGLang's cache factory and Dynamo's index are cheap; the registration code and
the in-process router path cost seconds each and only some properties need them, so they load
lazily and once. :meth:`Systems.with_cache` gives a view with another cache factory (another
KV-event format) that shares what was loaded, so a worker running both formats starts one path.
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
    #: what was loaded, shared by every :meth:`with_cache` view
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
        return self._loaded["path"]

    def with_cache(self, make_cache: Callable[[int, bool], Any]) -> Systems:
        return replace(self, make_cache=make_cache)

    def close(self) -> None:
        path = self._loaded.pop("path", None)
        if path is not None:
            path.close()
