"""``toy`` (opt-in): a whole property in one folder, for tests/unit/verify/props/test_registry.py.

This ``__init__`` is the registration (what ``check`` plans from: no Dynamo, no SGLang); the body
(:mod:`.body`), its generated input (:mod:`.strategies`) and its negative control (:mod:`.controls`)
sit beside it. Registered by one line, ``"toy"`` in :data:`kvalign.verify.props.HOMES` (the test
puts this folder on the package's path instead of copying it into ``kvalign/verify/props/``).
"""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import Budget, SearchProperty

TOY_BUDGET = Budget("toy", 20, "cap on generated prompts per toy row (default 20)")


def _body(systems: Any) -> Any:
    from kvalign.verify.props.toy.body import prefix_property

    return lambda case: prefix_property(systems.hasher, case)


def _strategy(mode: str, variant: str, page_size: int | None) -> Any:
    from kvalign.verify.props.toy.strategies import cut_prompts

    return cut_prompts(page_size)


PROPERTY = SearchProperty("toy", body=_body, strategy=_strategy, modes=("plain",), variants=("base",), default=False,
                          events="none", budget=TOY_BUDGET)
