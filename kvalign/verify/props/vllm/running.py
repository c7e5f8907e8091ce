"""How one row of ``check --engine vllm`` runs: its search, its negative control beside it, and the vLLM worker it
runs on. Apart from :mod:`.rows` (which lists the rows) so each row's module can use it without importing the list
that imports it.

A path that cannot answer is the row's ``n/a`` with the reason (``PATH_UNAVAILABLE``, as
:func:`~kvalign.verify.engine.property.unavailable` writes it), never an exception that ends the whole check: a
worker that cannot start (:func:`on_engine`) and a router that lacks what a row asks of it mid-search (Dynamo 1.0.2's
``KvRouter`` has no ``get_overlap_scores``, which the ``mm`` and ``tiers`` rows query: :func:`_row`) alike. Before
these two, such an :class:`~kvalign.oracles.base.OracleUnavailable` escaped the row and made the whole pair an
``error`` row of ``matrix --engine vllm``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvalign.model.causes import Cause
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.property import found_row, unavailable
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.props.vllm import controls
from kvalign.verify.props.vllm.controls import CONTROL_EXAMPLES

#: vLLM's blocks in the checked cache (one is vLLM's null block): small, so generated sequences evict
NUM_BLOCKS = 10
#: the block size when ``--page-size`` is not given
BLOCK_SIZE = 16


def _row(prop: str, variant: str, body: Any, strategy: Any, n: int, seed: int | None,
         control: tuple[str, Callable[[], Any], Cause] | None) -> RowResult:
    """The row's search and its control; a path that cannot answer in either is the row, unavailable with the reason."""
    start = time.perf_counter()
    try:
        return _searched(prop, variant, body, strategy, n, seed, control)
    except OracleUnavailable as exc:
        return unavailable(prop, ("plain",), (variant,), str(exc), seconds=time.perf_counter() - start)[0]


def _searched(prop: str, variant: str, body: Any, strategy: Any, n: int, seed: int | None,
              control: tuple[str, Callable[[], Any], Cause] | None) -> RowResult:
    from kvalign.verify.engine.search import Tally, run_search

    start, tally = time.perf_counter(), Tally()
    calls, failures, found = run_search(body, strategy, n, seed=seed, tally=tally)
    row = found_row(RowResult(prop, "plain", variant, calls, failures, time.perf_counter() - start), found)
    row.shrink_steps = tally.shrink_steps
    if control is not None:
        what, run_control, expected = control
        c_calls, _c_failures, c_found = run_control()
        row.control = {"mutation": what, "cases": c_calls, "failed": c_found is not None and c_found.cause == expected,
                       "cause": c_found.cause.name if c_found else None, "expected": expected.name}
        row.seconds = time.perf_counter() - start
    return row


def search_row(prop: str, body: Any, strategy: Any, n: int, seed: int | None,
               control: tuple[str, Callable[[], Any], Cause] | None, *, variant: str = "base") -> RowResult:
    """One row (``base`` unless ``variant``): the search of ``body`` over ``strategy``, its negative control
    beside it (None: a finding's row whose mechanism another row's control shows)."""
    return _row(prop, variant, body, strategy, n, seed, control)


def control_run(worker: Any, body: Any, seq: list[Any], seed: int | None, hop: Any = None) -> Callable[[], Any]:
    """A negative control: ``body`` on the fixed ``seq`` with ``hop`` applied on ``worker``'s hop (None: the hop left
    as it is, the mutation being in ``body``)."""
    from hypothesis import strategies as st

    from kvalign.verify.engine.search import run_search

    def run() -> Any:
        if hop is None:
            return run_search(body, st.just(seq), CONTROL_EXAMPLES, seed=seed)
        with controls.on_hop(worker, hop):
            return run_search(body, st.just(seq), CONTROL_EXAMPLES, seed=seed)
    return run


def on_engine(names: Sequence[tuple[str, str]], path: Any, b: int, num_blocks: int,
              rows: Callable[[Any], list[RowResult]], *, env: dict[str, str] | None = None,
              **options: Any) -> list[RowResult]:
    """``rows(worker)`` on a vLLM worker opened for them (``env``: vLLM's environment; ``options``: the engine's
    ``sliding_window`` / ``mamba`` / ``offload``), closed after them. Where the worker cannot start, or the path
    fails outside a row's search, every row named in ``names`` (``(prop, variant)``) is unavailable with the
    reason: the one place a row group's worker is opened, so none can let the exception escape."""
    from kvalign.oracles.vllm_router import vllm_worker

    start = time.perf_counter()
    try:
        worker = vllm_worker(path, b, num_blocks, env=env, **options)
    except OracleUnavailable as exc:
        return _unavailable(names, str(exc), time.perf_counter() - start)
    try:
        return rows(worker)
    except OracleUnavailable as exc:
        return _unavailable(names, str(exc), time.perf_counter() - start)
    finally:
        worker.close()


def _unavailable(names: Sequence[tuple[str, str]], why: str, seconds: float) -> list[RowResult]:
    return [r for p, v in names for r in unavailable(p, ("plain",), (v,), why, seconds=seconds)]
