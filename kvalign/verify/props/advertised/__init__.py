"""``advertised``: the block size Dynamo is told is the one SGLang's events carry
(:mod:`kvalign.verify.props.advertised.body`). Exhaustive over the page-size overrides the installed SGLang
has, so its rows (one per override) are known only when it runs: one job, plain mode only (a page
size does not depend on EAGLE's keys)."""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import Options, SetUpOnceProperty
from kvalign.verify.engine.rows import RowResult


def _rows(_systems: Any, modes: tuple[str, ...], opts: Options) -> list[RowResult]:
    from kvalign.verify.props.advertised.body import run_advertised_rows

    return run_advertised_rows(modes, opts.page_size)


PROPERTY = SetUpOnceProperty("advertised", rows=_rows, modes=("plain",), events="none", variants=(),
                             cost=3.5, shares="registration")
