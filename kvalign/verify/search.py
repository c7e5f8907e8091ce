"""The Hypothesis search every ``check`` row runs: find an input that raises :class:`Mismatch`, shrink it.

A leaf of the verification layer, so that a property module with rows of its own (``mm``) searches
the same way as ``check`` without importing it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure

from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.properties import Mismatch


def run_search(body: Callable[[Any], None], strategy: st.SearchStrategy[Any], examples: int, *, seed: int | None = None) -> tuple[int, int, Mismatch | None]:
    """Search ``strategy`` for an input on which ``body`` raises :class:`Mismatch`.

    Returns (cases run, failing cases seen, shrunk mismatch or None). An
    :class:`~kvalign.oracles.base.OracleUnavailable` from ``body`` (the environment failed: a transfer
    outlasted its timeout) ends the search at once and propagates as it was raised: shrinking it would
    sit out the same timeout per step, and one that did not recur would surface as Hypothesis's
    flaky-test error, not the one line of exit 2. Any other exception is a bug in the harness or an
    oracle and propagates.
    """
    calls = failures = 0
    broken: OracleUnavailable | None = None

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, print_blob=False,
              phases=(Phase.explicit, Phase.generate, Phase.shrink))
    @given(strategy)
    def search(value: Any) -> None:
        nonlocal calls, failures, broken
        if broken is not None:  # Hypothesis cannot be stopped from inside: the remaining examples do nothing
            return
        calls += 1
        try:
            body(value)
        except Mismatch:
            failures += 1
            raise
        except OracleUnavailable as exc:
            broken = exc

    if seed is not None:
        from hypothesis import seed as hseed

        search = hseed(seed)(search)
    found: Mismatch | None = None
    try:
        search()
    except Mismatch as exc:
        found = exc
    except FlakyFailure as flaky:
        if broken is not None:  # a replay that did nothing, after the environment failed
            raise broken from None
        # A mismatch that did not recur when Hypothesis replayed its example (1.3.1's in-process relay
        # drops some batches and not others) is still a mismatch the real path produced: report it as
        # found, saying it is intermittent, instead of crashing the row. Anything else propagates.
        found = next((e for e in flaky.exceptions if isinstance(e, Mismatch)), None)
        if found is None:
            raise
        found.detail += " (intermittent: the same example passed when replayed)"
    if broken is not None:  # whatever the search found before it, the examples after it did not run
        raise broken
    return calls, failures, found
