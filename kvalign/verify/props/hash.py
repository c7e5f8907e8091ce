"""``hash``: the router hasher equals kvalign's exact reference on any input (:func:`~kvalign.verify.engine.properties.hash_property`)."""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import SearchProperty
from kvalign.verify.engine.rows import VARIANTS


def missing_parameters(systems: Any) -> str:
    """A failing row's note: the parameters this release's hasher has not (it is called through an adapter)."""
    missing = getattr(systems.hasher, "missing", ())
    return f" [this release's compute_block_hash_for_seq has no {' / '.join(missing)} parameter]" if missing else ""


def _body(systems: Any) -> Any:
    from kvalign.verify.engine.properties import hash_property

    return lambda case: hash_property(systems.hasher, case)


def _strategy(mode: str, variant: str, page_size: int | None) -> Any:
    from kvalign.verify.engine.strategies import hash_cases

    lora, namespace = VARIANTS[variant]
    return hash_cases(eagle=mode == "eagle", lora=lora, namespace=namespace, mm=variant == "base", block_size=page_size)


PROPERTY = SearchProperty("hash", body=_body, strategy=_strategy, events="none", cost=1.0, note=missing_parameters)
