"""``overlap``: SGLang's reuse == kvalign's prediction == the real router index's answer
(:func:`~kvalign.verify.engine.properties.overlap_property`)."""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import SearchProperty
from kvalign.verify.props.hash import missing_parameters
from kvalign.verify.props.pages import scenario_strategy


def _body(systems: Any) -> Any:
    from kvalign.verify.engine.properties import overlap_property

    return lambda sc: overlap_property(systems.hasher, systems.make_cache, systems.make_index, sc)


PROPERTY = SearchProperty("overlap", body=_body, strategy=scenario_strategy, cost=0.8, note=missing_parameters)
