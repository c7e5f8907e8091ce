"""``tenants``: tenants caching the same tokens stay apart in the router's index
(:mod:`kvalign.verify.props.tenants.body`). No ``base`` row: one tenant has nothing to keep apart."""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import SearchProperty
from kvalign.verify.props.ingest import INGEST_BUDGET
from kvalign.verify.engine.rows import VARIANTS


def _body(systems: Any) -> Any:
    from kvalign.verify.props.tenants.body import tenants_property

    path = systems.router_path()
    return lambda sc: tenants_property(path, systems.make_cache, sc)


def _strategy(mode: str, variant: str, page_size: int | None) -> Any:
    from kvalign.verify.props.tenants.body import tenant_scenarios

    lora, namespace = VARIANTS[variant]
    sizes = {"page_sizes": (page_size,)} if page_size else {}
    return tenant_scenarios(eagle=mode == "eagle", lora=lora, namespace=namespace, **sizes)


PROPERTY = SearchProperty("tenants", body=_body, strategy=_strategy, budget=INGEST_BUDGET, surface="LoRA or namespace tenants",
                          variants=tuple(v for v in VARIANTS if v != "base"), cost=0.6)
