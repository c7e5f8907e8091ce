"""The properties ``check`` runs, one module each, and :data:`REGISTRY`: the one list of them, in display order.

What a property is: :mod:`kvalign.verify.property`. Importing this package imports neither Dynamo
nor SGLang (the CLI builds ``--property``'s choices from it); a property loads those when it runs.
"""

from __future__ import annotations

from kvalign.verify.property import Property
from kvalign.verify.props import advertised, card, dp, hash, hybrid, ingest, mm, overlap, pages, servable, storage, tenants, tier, vllm

#: Every property, in the order ``check`` prints its rows and ``matrix`` its columns.
REGISTRY: list[Property] = [
    card.PROPERTY,
    advertised.PROPERTY,
    hash.PROPERTY,
    pages.PROPERTY,
    overlap.PROPERTY,
    ingest.PROPERTY,
    tenants.PROPERTY,
    tier.PROPERTY,
    servable.PROPERTY,
    dp.PROPERTY,
    mm.PROPERTY,
    hybrid.PROPERTY,
    storage.PROPERTY,
    vllm.PROPERTY,
]


def by_name() -> dict[str, Property]:
    """The registered properties by name, in display order."""
    return {p.name: p for p in REGISTRY}


def names() -> tuple[str, ...]:
    """Every registered property's name (``--property``'s choices)."""
    return tuple(by_name())


def default_names() -> tuple[str, ...]:
    """What ``check`` and ``matrix`` run without ``--property``."""
    return tuple(p.name for p in REGISTRY if p.default)


def event_names() -> tuple[str, ...]:
    """The properties whose rows read SGLang's events from ``check``'s caches (run once per format)."""
    return tuple(p.name for p in REGISTRY if p.events == "each")

