"""Hypothesis's own record of the phase each test case ran in: the oracle that ``check``'s counts of
generated examples (:class:`kvalign.verify.engine.search.Tally`) are held against.

Hypothesis's observability callbacks (``add_observability_callback``, public since 6.x) report every
test case it runs with ``how_generated`` ("during generate phase", "during shrink phase", "minimal
failing test case"), which kvalign's search cannot read from inside a test body.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def recorded() -> Iterator[list[tuple[str, str]]]:
    """A list that fills with (how_generated, status) for every test case Hypothesis runs meanwhile."""
    from hypothesis.internal.observability import add_observability_callback, remove_observability_callback

    seen: list[tuple[str, str]] = []

    def record(observation: Any) -> None:
        if observation.type == "test_case":
            seen.append((observation.how_generated, observation.status))

    add_observability_callback(record)
    try:
        yield seen
    finally:
        remove_observability_callback(record)


def generated(seen: list[tuple[str, str]]) -> tuple[int, int]:
    """(generated examples the body ran, of them those that failed): a ``gave_up`` case never reached the body."""
    statuses = [status for how, status in seen if how.startswith("during generate phase") and status != "gave_up"]
    return len(statuses), statuses.count("failed")
