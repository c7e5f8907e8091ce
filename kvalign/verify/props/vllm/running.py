"""How one row of ``check --engine vllm`` runs: its search, its negative control beside it, and a vLLM worker of its
own where the row needs one. Apart from :mod:`.rows` (which lists the rows) so each row's module can use it without
importing the list that imports it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
               control: tuple[str, Callable[[], Any], Cause], *, variant: str = "base") -> RowResult:
    """One row (``base`` unless ``variant``): the search of ``body`` over ``strategy``, its negative control
    beside it."""
    return _row(prop, variant, body, strategy, n, seed, control)


def control_run(worker: Any, body: Any, seq: list[Any], seed: int | None, hop: Any) -> Callable[[], Any]:
    """A negative control: ``body`` on the fixed ``seq`` with ``hop`` applied on ``worker``'s hop."""
    from hypothesis import strategies as st

    from kvalign.verify.engine.search import run_search

    def run() -> Any:
        with controls.on_hop(worker, hop):
            return run_search(body, st.just(seq), CONTROL_EXAMPLES, seed=seed)
    return run


@contextmanager
def own_engine(prop: str, path: Any, b: int, num_blocks: int, *, variant: str = "base",
               **options: Any) -> Iterator[Any]:
    """A vLLM worker of its own for one row (``options``: the engine's ``sliding_window`` / ``mamba`` /
    ``offload``), closed after it; one that cannot start is the row (its ``variant``), unavailable with its cause."""
    from kvalign.oracles.vllm_router import vllm_worker

    start = time.perf_counter()
    try:
        worker = vllm_worker(path, b, num_blocks, **options)
    except OracleUnavailable as exc:
        yield unavailable(prop, ("plain",), (variant,), str(exc), seconds=time.perf_counter() - start)[0]
        return
    try:
        yield worker
    finally:
        worker.close()
