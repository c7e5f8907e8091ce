"""``kvalign check``'s engine: plan every registered property's jobs, run them, keep the rows in plan order.

A CI job or an engineer with a patched router wants one answer — aligned or not — plus, for a
failure, the smallest input that shows it and a named cause. Each property (one module of
:mod:`kvalign.verify.props`, behind the interface of :mod:`kvalign.verify.engine.property`) turns the
run's options into jobs and a job into rows; this module only orders, runs and labels them, so it
names no property. The rows come out in plan order (registry order, then each property's own),
whoever ran them and whenever they finished: :mod:`kvalign.verify.runner.pool` runs the same jobs in worker
processes (``check --jobs N``).

A piece of the path that cannot run for this release pair (registration code that does not import
with this SGLang, a relay that cannot start) is a row with a cause, not a crash: that is what a
deployment of the pair would hit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from kvalign.model.causes import Cause
from kvalign.verify.runner.confirm import confirm_rows
from kvalign.verify.runner.assess import assess
from kvalign.verify.engine.property import Job, Options, Property, row_format
from kvalign.verify.props import REGISTRY, by_name
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.engine.search import run_search  # noqa: F401 - re-exported: check's engine, as before
from kvalign.verify.engine.systems import Systems


def selected(props: Iterable[str] | None) -> list[Property]:
    """The registered properties named in ``props`` (registry order), or SGLang's default ones."""
    if props is None:
        return [p for p in REGISTRY if p.default and p.engine == "sglang"]
    wanted = set(props)
    return [p for p in REGISTRY if p.name in wanted]


def plan(props: Sequence[Property], formats: Sequence[str], opts: Options, *,
         format_missing: Callable[[str], str | None] = lambda _f: None) -> list[Job]:
    """Every job of one run, in the order its rows are printed: each property in each event format its
    rows read (a property that reads none runs with the first format only). ``format_missing(fmt)``:
    why this SGLang has no such format (its rows are then one ``skipped`` row per property and mode)."""
    jobs: list[Job] = []
    for i, fmt in enumerate(formats):
        for prop in props:
            if i and prop.events != "each":
                continue
            missing = format_missing(fmt)
            if missing:
                jobs.append(Job(prop.name, opts.modes, ("base",), fmt, cost=0.0, skipped=missing))
                continue
            jobs += [replace(job, event_format=fmt) for job in prop.jobs(opts)]
    return jobs


def run_job(k: int, job: Job, systems: Systems, opts: Options) -> list[RowResult]:
    """The rows of ``job``, the ``k``-th of the plan, each labelled with the event format its caches published in."""
    prop = by_name()[job.prop]
    systems.start_job(k)
    if job.skipped:
        rows = [RowResult(job.prop, m, v, skipped=job.skipped) for m in job.modes for v in job.variants]
    else:
        rows = confirm_rows(prop.run(job, systems, opts), systems.path_used(), lambda: _relay_apart(prop, job, systems, opts))
    for row in rows:
        row.event_format = job.event_format if job.skipped else row_format(prop, job.event_format)
    assess(rows, systems.router_path)  # each finding's class; a credit skew's bound and routing impact, measured here
    return rows


def _relay_apart(prop: Property, job: Job, systems: Systems, opts: Options) -> list[RowResult]:
    """``job``'s rows again, with each relay in a process of its own (:mod:`kvalign.verify.confirm`).

    The relay-apart path is shared by the run's re-checks; where a row of this one could not run on it
    (seen on 1.3.1: a router over one relay answering for two workers, the same two ids in later jobs),
    the job runs once more on a fresh path, so that no earlier re-check's state decides the row."""
    rows = prop.run(job, systems.relay_apart(), opts)
    if any(r.mismatches and not r.skipped and r.cause_name == Cause.PATH_UNAVAILABLE.name for r in rows):
        systems.close_apart()
        rows = prop.run(job, systems.relay_apart(), opts)
    return rows


def run_jobs(jobs: Sequence[Job], systems: Systems, opts: Options,
             progress: Callable[[RowResult], None] | None = None) -> list[RowResult]:
    """Run ``jobs`` one after another in this process (``check --jobs 1``)."""
    rows: list[RowResult] = []
    for k, job in enumerate(jobs):
        for row in run_job(k, job, systems.for_format(job.event_format), opts):
            rows.append(row)
            if progress:
                progress(row)
    return rows


def run_check(hasher: Any, make_cache: Callable[[int, bool], Any], make_index: Callable[[], Any], *,
              examples: int, props: Sequence[str] | None = None, modes: tuple[str, ...] | None = None,
              variants: tuple[str, ...] | None = None, seed: int | None = None,
              progress: Callable[[RowResult], None] | None = None, systems: Systems | None = None,
              caps: dict[str, int] | None = None, page_size: int | None = None,
              event_format: str = "default") -> list[RowResult]:
    """Run the requested properties (default: the default ones) x modes x variants in this process, one
    row each; ``page_size`` pins the page size of every generated case (None: every size the strategies
    draw); ``caps``: example caps by budget option (``{"ingest": 25}``); ``event_format``: the KV-event
    format ``make_cache``'s caches publish in."""
    opts = Options(examples=examples, seed=seed, page_size=page_size, caps=tuple(sorted((caps or {}).items())),
                   **({"modes": modes} if modes else {}), **({"variants": variants} if variants else {}))
    systems = systems or Systems(hasher, make_cache, make_index)
    try:
        return run_jobs(plan(selected(props), (event_format,), opts), systems, opts, progress)
    finally:
        systems.close()
