"""The Hypothesis search every ``check`` row runs: find an input that raises :class:`Mismatch`, shrink it.

A leaf of the verification layer, so that a property module with rows of its own (``mm``) searches
the same way as ``check`` without importing it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure

from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.properties import Mismatch


@dataclass
class Tally:
    """A search's calls of its body: the generated examples, and apart from them the shrink steps.

    Hypothesis generates examples, then shrinks the first failing one, calling the body once per shrink
    step and once more to replay the shrunk example. A row that counted every call read "49 of 96" for
    a search that generated three examples (issue 43), so ``cases`` and ``mismatches`` are of generated
    examples only. Hypothesis tells a body nothing of its phase, but with
    ``report_multiple_bugs=False`` (every search kvalign runs) it ends generation at the first failing
    example (``ConjectureRunner.should_generate_more``): a call is a generated example exactly when no
    call before it failed. tests/unit/verify/engine/test_search.py holds this against Hypothesis's own record
    of each call's phase (its observability callbacks).

    A body that counts things per example (storage's refills, hybrid's lost state) reads
    :attr:`generating` so that its counts are of generated examples too."""

    #: generated examples the body ran
    cases: int = 0
    #: of them, those that failed: 0 or 1 (the search stops generating at the first, to shrink it)
    mismatches: int = 0
    #: calls after the first failure: shrink attempts and the replay of the shrunk example
    shrink_steps: int = 0
    #: whether the call under way is a generated example (False: a shrink step)
    generating: bool = True

    def start(self) -> None:
        """A call of the body begins: a generated example until one has failed, a shrink step after."""
        self.generating = self.mismatches == 0
        if self.generating:
            self.cases += 1
        else:
            self.shrink_steps += 1

    def fail(self) -> None:
        """The call under way failed: a mismatch if it was a generated example (a failing shrink step is not one)."""
        if self.generating:
            self.mismatches += 1


#: Replays of a mismatch's example that did not recur when Hypothesis replayed it (issue 46).
REPLAYS = 10


def replay_rate(body: Callable[[Any], None], example: Any, replays: int = REPLAYS) -> int:
    """How many of ``replays`` runs of ``body`` on ``example`` raised :class:`Mismatch` (an
    :class:`~kvalign.oracles.base.OracleUnavailable` propagates: the environment failed, not the example)."""
    failed = 0
    for _ in range(replays):
        try:
            body(copy.deepcopy(example))  # a body may change what it was handed
        except Mismatch:
            failed += 1
    return failed


def generated_cause(found: Mismatch | None, generated: Mismatch | None) -> Mismatch | None:
    """The mismatch a state-machine search reports: the shrunk one where it fails for the cause of the generated
    example it was shrunk from, else that generated example's own.

    Which example a tier machine's shrinking ends at depends on which shrink steps failed, and whether
    Hypothesis's last replay of it failed; through a release's relay and router those vary from run to run, and
    so did the row: 1.3.1's ``tier/eagle/namespace`` (relay in its own process) was ``EVENTS_DROPPED`` in one
    matrix run (a shrunk example) and ``TIER_MISFILED`` in the next (the generated one, Hypothesis's replay of
    the shrunk one having passed), each recurring in 10 of 10 replays (issue 46). The generated example is what
    a derandomized search draws, the same in every run: its cause is the row's, and shrinking only makes it
    smaller. (:func:`run_search` keeps the shrunk example's cause: its hash-keyed bodies are deterministic, and
    there shrinking reaches the simpler cause, e.g. ``ROUTER_EAGLE_OFF`` under a salted EAGLE example's
    ``SEED_DRIFT``.)"""
    if found is None or generated is None or found is generated or found.cause is generated.cause:
        return found
    generated.detail += f" (not shrunk: shrinking it reached another cause, {found.cause.name})"
    return generated


def run_search(body: Callable[[Any], None], strategy: st.SearchStrategy[Any], examples: int, *, seed: int | None = None,
               tally: Tally | None = None, shrink: bool = True) -> tuple[int, int, Mismatch | None]:
    """Search ``strategy`` for an input on which ``body`` raises :class:`Mismatch`.

    Returns (generated examples run, of them the failing ones, shrunk mismatch or None): shrink steps
    are not cases (:class:`Tally`; pass one to read them, or to let ``body`` read :attr:`Tally.generating`). An
    :class:`~kvalign.oracles.base.OracleUnavailable` from ``body`` (the environment failed: a transfer
    outlasted its timeout) ends the search at once and propagates as it was raised: shrinking it would
    sit out the same timeout per step, and one that did not recur would surface as Hypothesis's
    flaky-test error, not the one line of exit 2. Any other exception is a bug in the harness or an
    oracle and propagates. A generated example that fails is replayed :data:`REPLAYS` times at once: one
    whose mismatch does not recur in every replay is no failure (the search goes on, so a mismatch that
    does recur is still found after it: 1.0.2's ingest rows once stopped at an intermittent INGEST_STALE
    that recurred on its one replay, and missed the salt finding after it); where the search found nothing else, the first such mismatch is returned with
    :attr:`~kvalign.verify.engine.properties.Mismatch.unconfirmed`, its rate over :data:`REPLAYS` replays
    (never a finding: 0 failing examples). A mismatch that did not recur when Hypothesis replayed its
    shrunk example is replayed :data:`REPLAYS` times more, and is unconfirmed unless it recurred every time;
    so is the shrunk example of a search that ended with a mismatch Hypothesis did replay: one replay of
    a mismatch that recurs in some runs only (1.3.1's relay apart dropping a salted EAGLE page) would
    make it a finding in some matrix runs and not in others (issue 46), ten make both kinds stable.

    ``shrink=False``: the generated example is returned as found, already replayed :data:`REPLAYS` times and by
    Hypothesis once; for a caller that keeps only whether and why the search failed (a negative control).
    """
    tally = tally if tally is not None else Tally()
    broken: OracleUnavailable | None = None
    #: generated examples whose mismatch did not recur in every replay at once
    flaky: list[Mismatch] = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, print_blob=False,
              phases=(Phase.explicit, Phase.generate, Phase.shrink) if shrink else (Phase.explicit, Phase.generate))
    @given(strategy)
    def search(value: Any) -> None:
        nonlocal broken
        if broken is not None:  # Hypothesis cannot be stopped from inside: the remaining examples do nothing
            return
        tally.start()
        replay = copy.deepcopy(value)  # the example as drawn: a body may change what it was handed
        try:
            body(value)
        except Mismatch as exc:
            exc.drawn = replay
            if tally.generating and replay_rate(body, replay) < REPLAYS:
                flaky.append(exc)  # not a failure: the search goes on, so a real mismatch after it is still found
                return
            tally.fail()
            raise
        except OracleUnavailable as exc:
            broken = exc

    if seed is not None:
        from hypothesis import seed as hseed

        search = hseed(seed)(search)
    found: Mismatch | None = None
    #: whether ``found`` is a generated example confirmed by its REPLAYS replays at once and Hypothesis's replay
    confirmed = False
    try:
        search()
    except Mismatch as exc:
        found, confirmed = exc, not shrink
    except FlakyFailure as flaky:
        if broken is not None:  # a replay that did nothing, after the environment failed
            raise broken from None
        # A mismatch that did not recur when Hypothesis replayed its example: replayed REPLAYS times more,
        # and shown with how often it recurred, never as a finding (kvalign.verify.runner.confirm). Anything else
        # propagates.
        found = next((e for e in flaky.exceptions if isinstance(e, Mismatch)), None)
        if found is None:
            raise
    if broken is not None:  # whatever the search found before it, the examples after it did not run
        raise broken
    # a finding recurs every time its example is replayed, however Hypothesis ended (unshrunk: replayed already)
    if found is not None and not confirmed:
        recurred = replay_rate(body, found.drawn)
        if recurred < REPLAYS:
            found.unconfirmed = f"recurred in {recurred} of {REPLAYS} replays of its example"
    if found is None and flaky:  # only mismatches that did not recur: the first, with its rate over REPLAYS replays
        found = flaky[0]
        found.unconfirmed = (f"recurred in {replay_rate(body, found.drawn, REPLAYS - 1)} of {REPLAYS} replays of "
                             "its example")
    return tally.cases, tally.mismatches, found
