"""The properties ``check`` runs, one home each, and :data:`REGISTRY`: the one list of them, in display order.

A property's home is a module or a package of this package (``props/mm/``: its registration in
``__init__``, its body, strategies, negative controls and report section beside it) whose
``PROPERTY`` is the property (:mod:`kvalign.verify.engine.property` says what that is). Adding a
property is its home and one line in :data:`HOMES`.

Importing this package imports neither Dynamo nor SGLang (the CLI builds ``--property``'s choices
from it); a property loads those when it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from kvalign.verify.engine.property import Property

#: Every property's home, in the order ``check`` prints its rows and ``matrix`` its columns.
HOMES = (
    "card",
    "advertised",
    "hash",
    "pages",
    "overlap",
    "ingest",
    "tenants",
    "tier",
    "servable",
    "dp",
    "mm",
    "hybrid",
    "storage",
    "vllm",
    "vllm_bytes",
)


def load(homes: Iterable[str]) -> list[Property]:
    """The ``PROPERTY`` of each home, a module or package of this package, in the order given."""
    return [importlib.import_module(f"{__name__}.{home}").PROPERTY for home in homes]


#: Every property, in display order (:data:`HOMES`).
REGISTRY: list[Property] = load(HOMES)


def by_name() -> dict[str, Property]:
    """The registered properties by name, in display order."""
    return {p.name: p for p in REGISTRY}


def names() -> tuple[str, ...]:
    """Every registered property's name (``--property``'s choices)."""
    return tuple(by_name())


def default_names(engine: str = "sglang") -> tuple[str, ...]:
    """What ``check --engine ENGINE`` and ``matrix --engine ENGINE`` run without ``--property`` or ``--all``."""
    return tuple(p.name for p in REGISTRY if p.default and p.engine == engine)


def opt_in_names(engine: str) -> tuple[str, ...]:
    """The properties of ``engine`` that only ``--all`` (or ``--property``) runs."""
    return tuple(p.name for p in REGISTRY if not p.default and p.engine == engine)


def event_names() -> tuple[str, ...]:
    """The properties whose rows read SGLang's events from ``check``'s caches (run once per format)."""
    return tuple(p.name for p in REGISTRY if p.events == "each")


def of_engine(engine: str) -> list[Property]:
    """The properties ``check --engine ENGINE`` runs, in display order."""
    return [p for p in REGISTRY if p.engine == engine]
