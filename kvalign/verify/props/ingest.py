"""``ingest``: SGLang's published events through Dynamo's real relay and event plane into a real
``KvRouter`` give SGLang's reuse (:func:`~kvalign.verify.engine.properties.ingest_property`)."""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import Budget, SearchProperty
from kvalign.verify.engine.rows import VARIANTS

#: Each case runs the real relay and router: ``ingest`` and ``tenants`` share this cap.
INGEST_BUDGET = Budget("ingest", 25, "cap on generated cases per ingest / tenants row (each runs the real relay "
                                     "and router; default 25)")


def _body(systems: Any) -> Any:
    from kvalign.verify.engine.properties import ingest_property

    path = systems.router_path()
    return lambda isc: ingest_property(path, systems.hasher, systems.make_cache, isc)


def _strategy(mode: str, variant: str, page_size: int | None) -> Any:
    from kvalign.verify.engine.strategies import ingest_scenarios

    lora, namespace = VARIANTS[variant]
    sizes = {"page_sizes": (page_size,)} if page_size else {}
    return ingest_scenarios(eagle=mode == "eagle", lora=lora, namespace=namespace, **sizes)


PROPERTY = SearchProperty("ingest", body=_body, strategy=_strategy, budget=INGEST_BUDGET, cost=0.6)
