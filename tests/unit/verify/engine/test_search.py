"""``check``'s counts are of generated examples: a search's shrink steps are counted apart (issue 43).

Hypothesis generates examples, then shrinks the first failing one, calling the body again for every
shrink step; a row that counted those calls said "49 of 96" of a search that generated three. The
generated examples are told from the shrink steps by Hypothesis's own record of each case's phase
(:mod:`hypothesis_phases`). Pure Hypothesis: no Dynamo, no SGLang.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis_phases import generated, recorded

from kvalign.model.causes import Cause
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.engine.search import REPLAYS


def _failing_from(threshold: int, calls: list[int]) -> Any:
    def body(x: int) -> None:
        calls.append(x)
        if x >= threshold:
            raise Mismatch("toy", f"{x} >= {threshold}", Cause.UNKNOWN, x)

    return body


def test_cases_and_mismatches_are_generated_examples_not_shrink_steps() -> None:
    from kvalign.verify.engine.search import run_search

    calls: list[int] = []
    with recorded() as seen:
        cases, mismatches, found = run_search(_failing_from(10, calls), st.integers(0, 10_000), 50)
    assert found is not None and found.example == 10  # shrunk to the smallest failing input
    assert (cases, mismatches) == generated(seen), (cases, mismatches, generated(seen), len(calls))
    assert mismatches == 1 and len(calls) > cases  # the search stops at the first failure, then shrinks it


def test_a_search_without_a_failure_counts_every_example_and_no_shrink_step() -> None:
    from kvalign.verify.engine.search import Tally, run_search

    calls: list[int] = []
    tally = Tally()
    with recorded() as seen:
        cases, mismatches, found = run_search(_failing_from(1 << 20, calls), st.integers(0, 10_000), 30, tally=tally)
    assert found is None and (cases, mismatches) == generated(seen) == (30, 0) == (len(calls), 0)
    assert tally.shrink_steps == 0


def test_a_search_without_shrinking_returns_the_generated_example_replayed_and_no_more() -> None:
    """``shrink=False`` (a negative control, whose row keeps only the cause): the first failing generated example,
    its REPLAYS replays at once and Hypothesis's one replay of it, nothing after; the same search shrinks when asked."""
    from kvalign.verify.engine.search import Tally, run_search

    calls: list[int] = []
    tally = Tally()
    with recorded() as seen:
        cases, mismatches, found = run_search(_failing_from(10, calls), st.integers(0, 10_000), 50, tally=tally,
                                              shrink=False)
    assert (cases, mismatches) == generated(seen) and mismatches == 1
    assert found is not None and found.example == calls[cases - 1] >= 10 and not found.unconfirmed
    assert tally.shrink_steps == 1 and len(calls) == cases + REPLAYS + 1, (len(calls), cases)
    shrunk: list[int] = []
    assert run_search(_failing_from(10, shrunk), st.integers(0, 10_000), 50)[2].example == 10 and len(shrunk) > len(calls)


def test_a_search_rows_shrink_steps_are_apart_in_its_json() -> None:
    """A :class:`SearchProperty` row: ``cases`` and ``mismatches`` from the generated examples, the shrink
    steps (and the replay of the shrunk example) in ``shrink_steps``, in ``check --json`` too."""
    from kvalign.verify.engine.property import Options, SearchProperty
    from kvalign.verify.engine.rows import row_json

    calls: list[int] = []
    prop = SearchProperty("toy", modes=("plain",), variants=("base",), events="none",
                          body=lambda _systems: _failing_from(10, calls),
                          strategy=lambda _mode, _variant, _page: st.integers(0, 10_000))
    opts = Options(examples=50, modes=("plain",), variants=("base",))
    with recorded() as seen:
        [row] = prop.run(prop.jobs(opts)[0], None, opts)
    assert (row.cases, row.mismatches) == generated(seen) and row.mismatches == 1
    # every call but the generated examples, the failing one's REPLAYS replays at once and the shrunk one's
    # REPLAYS confirming replays (issue 46) is a shrink step
    assert row.shrink_steps == len(calls) - row.cases - 2 * REPLAYS > 0
    report = row_json(row)
    assert (report["cases"], report["mismatches"], report["shrink_steps"]) == (row.cases, 1, row.shrink_steps)



def test_a_state_machine_search_reports_the_generated_examples_cause_where_shrinking_reached_another() -> None:
    """Which example a tier machine's shrinking ends at varied from run to run on 1.3.1, and with it the row's
    cause; the generated example is the same in every run: its cause is the row's, noted as not shrunk."""
    from kvalign.verify.engine.search import generated_cause

    generated = Mismatch("tier", "generated", Cause.TIER_MISFILED, {"steps": [1, 2, 3]})
    shrunk = Mismatch("tier", "shrunk", Cause.EVENTS_DROPPED, {"steps": [1]})
    got = generated_cause(shrunk, generated)
    assert got is generated and got.cause is Cause.TIER_MISFILED
    assert got.detail == "generated (not shrunk: shrinking it reached another cause, EVENTS_DROPPED)"


def test_a_shrunk_example_with_the_generated_examples_cause_is_kept() -> None:
    """The negative control: where shrinking keeps the cause, the row is the shrunk example, unchanged."""
    from kvalign.verify.engine.search import generated_cause

    generated = Mismatch("tier", "generated", Cause.TIER_MISFILED, {"steps": [1, 2, 3]})
    shrunk = Mismatch("tier", "shrunk", Cause.TIER_MISFILED, {"steps": [1]})
    assert generated_cause(shrunk, generated) is shrunk and shrunk.detail == "shrunk"
    assert generated_cause(generated, generated) is generated and generated.detail == "generated"
    assert generated_cause(None, generated) is None and generated_cause(shrunk, None) is shrunk
