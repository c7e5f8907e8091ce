"""``mm`` (opt-in): image prompts through Dynamo's real frontend and SGLang's real multimodal path
(:mod:`kvalign.verify.props.mm.body`). One job for both modes: the frontend and the processor start once
(20-40 s on two cores)."""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import Budget, Options, SetUpOnceProperty
from kvalign.verify.engine.rows import RowResult

MM_BUDGET = Budget("mm", 25, "cap on generated image scenarios per mm row (default 25; each runs two chat requests "
                             "through Dynamo's frontend and SGLang's multimodal path)")


def _rows(systems: Any, modes: tuple[str, ...], opts: Options) -> list[RowResult]:
    from kvalign.verify.props.mm.body import run_mm_rows

    return run_mm_rows(systems, modes, opts.examples_for(MM_BUDGET), opts.seed, page_size=opts.page_size)


PROPERTY = SetUpOnceProperty("mm", rows=_rows, default=False, surface="image prompts", events="each", budget=MM_BUDGET, cost=60.0)
