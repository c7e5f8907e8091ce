"""``pages``: every page SGLang stores, hashed worker-side, equals the router's query-side block
(:func:`~kvalign.verify.engine.properties.pages_property`)."""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import SearchProperty
from kvalign.verify.props.hash import missing_parameters
from kvalign.verify.engine.rows import VARIANTS


def _body(systems: Any) -> Any:
    from kvalign.verify.engine.properties import pages_property

    return lambda sc: pages_property(systems.hasher, systems.make_cache, sc)


def scenario_strategy(mode: str, variant: str, page_size: int | None) -> Any:
    """One worker's inserts and a query (``pages`` and ``overlap``), at ``page_size`` or every size drawn."""
    from kvalign.verify.engine.strategies import scenarios

    lora, namespace = VARIANTS[variant]
    sizes = {"page_sizes": (page_size,)} if page_size else {}
    return scenarios(eagle=mode == "eagle", lora=lora, namespace=namespace, **sizes)


PROPERTY = SearchProperty("pages", body=_body, strategy=scenario_strategy, cost=0.8, note=missing_parameters)
