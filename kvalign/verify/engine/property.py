"""The property interface: all that ``check``, ``matrix`` and their outputs know of a property.

A property is one home in :mod:`kvalign.verify.props` (a module, or a package holding its body,
strategies, negative controls and report section) whose ``PROPERTY`` has these attributes
(:class:`Property`); :data:`kvalign.verify.props.REGISTRY` lists them in display order. Adding a
property is that home plus one line in :data:`kvalign.verify.props.HOMES`: ``check --property``, the
text table, ``--json``, ``matrix`` (its columns, ``--markdown``) and docs/check.md's list read the
registry, and nothing in :mod:`kvalign.verify.runner.check` branches on a property's name.

``name``
    the ``--property`` value and every row's ``prop``.
``modes``
    the key modes it has rows in, a subset of :data:`~kvalign.verify.engine.rows.MODES` (a page size does
    not depend on EAGLE's keys: ``advertised`` has ``("plain",)``).
``default``
    whether ``check`` / ``matrix`` run it without ``--property`` (``mm`` is opt-in).
``engine``
    the engine behind the router its rows drive (``check --engine``): ``sglang``, or ``vllm``.
``surface``
    the part of a deployment its rows speak for where not every deployment has it (``"image
    prompts"``), or None where every one does (block keys, events). A verdict names what did not run
    by it: "aligned for deployments without image prompts" (:mod:`kvalign.verify.engine.scope`).
``events``
    which of SGLang's KV-event formats its rows read: ``"each"`` (caches built by ``check``; run once
    per ``--event-format``), ``"own"`` (caches it builds itself, in the default format; run once) or
    ``"none"`` (run once; its rows say ``any``).
``budget``
    its example cap, a :class:`Budget` (``check --NAME-examples``; several properties may share one),
    or None: its rows run ``--examples`` cases, or are exhaustive.
``jobs(opts)``
    its units of work for one run, in display order (:class:`Job`): each a row, or rows that share an
    expensive set-up (``card``'s registration load, ``mm``'s frontend). A job is the unit a ``check
    --jobs N`` worker takes from the queue (longest ``cost`` first); the rows are printed in plan
    order whatever finishes first. Planning is cheap and imports neither Dynamo nor SGLang.
``run(job, systems, opts)``
    the job's rows (:class:`~kvalign.verify.engine.rows.RowResult`), driving the real systems
    (:class:`~kvalign.verify.engine.systems.Systems`); a piece that cannot run is a row with a cause or a
    ``skipped`` reason, never an exception. It runs in a worker process as well as in ``check``'s
    own, so it keeps nothing between jobs but what ``systems`` caches.

Most properties are one Hypothesis search per mode x variant; :class:`SearchProperty` builds those
from a body and a strategy, as Hypothesis composes strategies (``hash``: ``SearchProperty("hash",
body=..., strategy=...)``). :class:`SetUpOnceProperty` builds one whose rows share a set-up from the
function that makes them (``card``, ``advertised``, ``mm``). The rest implement ``jobs`` and ``run``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Literal, Protocol

from kvalign.model.causes import Cause
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.rows import MODES, VARIANTS, RowResult

Events = Literal["each", "own", "none"]


@dataclass(frozen=True)
class Budget:
    """An example cap a property's rows share with others: ``check --{option}-examples`` (default ``default``)."""

    option: str
    default: int
    help: str


@dataclass(frozen=True)
class Options:
    """What one ``check`` run asks of every property (picklable: workers get a copy)."""

    examples: int = 200
    modes: tuple[str, ...] = MODES
    variants: tuple[str, ...] = tuple(VARIANTS)
    seed: int | None = None
    page_size: int | None = None
    #: ``--NAME-examples`` the user gave, by :attr:`Budget.option`
    caps: tuple[tuple[str, int], ...] = ()

    def examples_for(self, budget: Budget | None) -> int:
        """Cases per row under ``budget``: the smaller of ``--examples`` and its cap (given, else its default)."""
        if budget is None:
            return self.examples
        return min(self.examples, dict(self.caps).get(budget.option) or budget.default)


@dataclass(frozen=True)
class Job:
    """A unit of work: the rows of ``prop`` in ``modes`` x ``variants`` (an empty ``variants``: those the
    property finds when it runs), with SGLang's events in ``event_format``; ``cost``: its expected
    seconds on the pinned pair, for the longest-first queue."""

    prop: str
    modes: tuple[str, ...]
    variants: tuple[str, ...] = ("base",)
    event_format: str = "default"
    cost: float = 1.0
    #: why these rows cannot run with this release (its rows are ``skipped`` with it, nothing runs)
    skipped: str | None = None
    #: a set-up this job loads once per process and other jobs load too (``"registration"``: dynamo.sglang's
    #: import, about 1.2 s of CPU, by card, advertised and dp); ``check --jobs`` hands such jobs to the worker
    #: that loaded it where it can
    shares: str | None = None

    def label(self) -> str:
        """The job as a row name (``tier/eagle/lora``), for progress and a worker's error line."""
        return f"{self.prop}/{'+'.join(self.modes)}/{'+'.join(self.variants) or '*'}"


class Property(Protocol):
    """See the module docstring."""

    name: str
    modes: tuple[str, ...]
    default: bool
    surface: str | None
    engine: str
    events: Events
    budget: Budget | None

    def jobs(self, opts: Options) -> list[Job]: ...

    def run(self, job: Job, systems: Any, opts: Options) -> list[RowResult]: ...


def row_format(prop: Property, event_format: str) -> str:
    """The ``event_format`` a row of ``prop`` carries when its caches publish in ``event_format``."""
    return {"each": event_format, "own": "default", "none": "any"}[prop.events]


def plain(value: Any) -> Any:
    """A counterexample as the JSON report holds it."""
    return asdict(value) if is_dataclass(value) else value


def found_row(row: RowResult, found: Any) -> RowResult:
    """``row`` with a search's shrunk :class:`~kvalign.verify.engine.properties.Mismatch` (or None) written in."""
    if found is not None:
        row.cause, row.cause_name, row.detail = found.cause.value, found.cause.name, found.detail
        row.counterexample = plain(found.example)
        row.condition = getattr(found, "condition", None)
        row.unconfirmed = getattr(found, "unconfirmed", None)
    return row


def unavailable(prop: str, modes: tuple[str, ...], variants: tuple[str, ...], why: str,
                cause: Cause = Cause.PATH_UNAVAILABLE, seconds: float = 0.0) -> list[RowResult]:
    """The rows of a job whose systems cannot start here: a finding with a cause, not a crash."""
    return [RowResult(prop, m, v, 0, 1, seconds, cause.value, cause.name, why) for m in modes for v in variants]


Body = Callable[[Any], Callable[[Any], None]]
Strategy = Callable[[str, str, int | None], Any]


@dataclass(frozen=True)
class Declared:
    """What every property says of itself (the module docstring), for the two builders below; ``cost``:
    the seconds one job takes at its default example count, measured on the pinned pair (only the
    longest-first order of ``check --jobs`` reads it); ``shares``: its jobs' :attr:`Job.shares`."""

    name: str
    modes: tuple[str, ...] = MODES
    default: bool = True
    surface: str | None = None
    engine: str = "sglang"
    events: Events = "each"
    budget: Budget | None = None
    cost: float = 1.0
    #: what its jobs' :attr:`Job.shares` says
    shares: str | None = None


@dataclass(frozen=True)
class SearchProperty(Declared):
    """A property that is one Hypothesis search per mode x variant.

    ``body(systems)`` binds the per-example check to the systems under test (it may raise
    :class:`~kvalign.oracles.base.OracleUnavailable`: every row is then ``PATH_UNAVAILABLE``);
    ``strategy(mode, variant, page_size)`` is the row's generated input; ``variants`` the ones it has
    rows for (None: every variant asked)."""

    body: Body = field(kw_only=True)
    strategy: Strategy = field(kw_only=True)
    variants: tuple[str, ...] | None = None
    #: a note a failing row's detail gets from the systems (e.g. a parameter the release's hasher lacks)
    note: Callable[[Any], str] | None = field(default=None, compare=False)

    def jobs(self, opts: Options) -> list[Job]:
        variants = tuple(v for v in opts.variants if self.variants is None or v in self.variants)
        scale = opts.examples_for(self.budget) / (self.budget.default if self.budget else Options.examples)
        return [Job(self.name, (m,), (v,), cost=self.cost * scale, shares=self.shares)
                for m in self.modes if m in opts.modes for v in variants]

    def run(self, job: Job, systems: Any, opts: Options) -> list[RowResult]:
        from kvalign.verify.engine.search import Tally, run_search

        try:
            body = self.body(systems)
        except OracleUnavailable as exc:  # the relay / router of this release cannot start here
            return unavailable(self.name, job.modes, job.variants, str(exc))
        rows = []
        for mode in job.modes:
            for variant in job.variants:
                start, tally = time.perf_counter(), Tally()
                calls, failures, found = run_search(body, self.strategy(mode, variant, opts.page_size),
                                                    opts.examples_for(self.budget), seed=opts.seed, tally=tally)
                row = found_row(RowResult(self.name, mode, variant, calls, failures, time.perf_counter() - start), found)
                row.shrink_steps = tally.shrink_steps
                if row.detail and found is not None and self.note is not None:
                    row.detail += self.note(systems)
                rows.append(row)
        return rows


Rows = Callable[[Any, tuple[str, ...], Options], list[RowResult]]


@dataclass(frozen=True)
class SetUpOnceProperty(Declared):
    """A property whose rows, every mode asked, share one expensive set-up (a registration load, a frontend):
    one job, whose rows ``rows(systems, modes, opts)`` gives; ``variants`` () when they are known only then."""

    rows: Rows = field(kw_only=True)
    variants: tuple[str, ...] = ("base",)

    def jobs(self, opts: Options) -> list[Job]:
        modes = tuple(m for m in self.modes if m in opts.modes)
        return [Job(self.name, modes, self.variants, cost=self.cost, shares=self.shares)] if modes else []

    def run(self, job: Job, systems: Any, opts: Options) -> list[RowResult]:
        return self.rows(systems, job.modes, opts)
