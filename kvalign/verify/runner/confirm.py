"""A finding reproduces before it is published: what ``check`` does with a job's rows before it classes them.

The release matrix is how a user learns which pair is safe, so a row that fails must fail for the
release, not for the harness. One rule for every property on every pair, applied by
:func:`confirm_rows` to each job's rows (the same in ``check --jobs 1`` and in a worker):

- **The environment is not a finding.** A row whose path could not start (``PATH_UNAVAILABLE``: a
  relay or router that would not start here, a relay that never indexed even the first sentinel
  page) is ``n/a`` with what it saw as the reason, never a cause; where it went through the in-process
  path it is re-checked first, as below, and where the re-check could not run either it stays the
  environment's (never "only with the relay in kvalign's process": vLLM 0.23.0 has no offload connector
  for the tiers row in either layout).
- **No in-process artifact.** ``check`` runs a release's relay and router inside its own process
  (:class:`~kvalign.oracles.router_path.RouterPath`); a deployment runs the relay in the worker's
  process. A cache-blind finding (``PATH_UNAVAILABLE`` included) of a job that went through that path is
  re-checked with each relay in
  a process of its own (:meth:`~kvalign.verify.engine.systems.Systems.relay_apart`): the same job, same
  options and seed, so the same examples. An unconfirmed one is re-checked too (where the in-process
  relay stops varies from run to run, so whether its mismatch recurred there says nothing of the
  release). Where that run finds it too, the row is the re-check's (what a deployment's layout shows:
  a finding, or unconfirmed with its rate there, with the in-process cause named where it differed);
  where it runs clean, the row is ``n/a``, saying that only the in-process run showed it.
- **Intermittent is unconfirmed** (:mod:`kvalign.verify.engine.search`): a mismatch that did not recur when
  its example was replayed is replayed :data:`~kvalign.verify.engine.search.REPLAYS` times and shown with
  its rate as ``unconfirmed``, a status that fails nothing.
- **UNKNOWN is never published**: a confirmed mismatch kvalign cannot name is shown with what it saw
  and ends ``check`` in exit 2 (:func:`unexplained`), never a cache-blind finding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from kvalign.model.causes import CACHE_BLIND, Cause, cause_class
from kvalign.verify.engine.rows import RowResult

IN_PROCESS_ONLY = "only with the relay in kvalign's process"


def environment_rows(rows: Sequence[RowResult]) -> None:
    """Every ``PATH_UNAVAILABLE`` row becomes ``n/a``, its detail the reason (a path that cannot start is
    the environment, not the release)."""
    for r in rows:
        if not r.skipped and r.mismatches and r.cause_name == Cause.PATH_UNAVAILABLE.name:
            r.skipped = f"the path could not run here: {r.detail or 'no detail'}"
            r.cause = r.cause_name = None


def _recheckable(r: RowResult) -> bool:
    """A row with a cache-blind cause, confirmed or not, or whose path could not run: in kvalign's process
    the relay stops indexing at a point that varies from run to run, so what such a row shows there (a
    finding, or a mismatch that recurred in only some replays) is the harness until the relay apart says
    otherwise; the row is then what that run shows, whatever the in-process run happened to see."""
    return (not r.skipped and bool(r.mismatches) and r.cause_name is not None
            and cause_class(r.cause_name) == CACHE_BLIND)


def confirm_rows(rows: list[RowResult], path_used: bool, rerun: Callable[[], list[RowResult]]) -> list[RowResult]:
    """``rows`` as they may be published: see the module docstring. ``path_used``: whether the job ran
    through the in-process router path; ``rerun()``: the same job with each relay in its own process."""
    if not path_used or not any(_recheckable(r) for r in rows):
        environment_rows(rows)
        return rows
    apart = {(r.prop, r.mode, r.variant): r for r in rerun()}
    environment_rows(list(apart.values()))
    out = []
    for r in rows:
        other = apart.get((r.prop, r.mode, r.variant))
        if not _recheckable(r):
            environment_rows([r])
            out.append(r)
        elif other is None:  # the re-check has no such row: nothing confirms it
            out.append(_in_process_only(r, "the re-check ran no such row"))
        elif other.skipped and r.cause_name == Cause.PATH_UNAVAILABLE.name:  # neither layout could run it
            environment_rows([r])
            r.skipped = f"{r.skipped}; with the relay in its own process too ({other.skipped})"
            out.append(r)
        elif other.skipped:
            out.append(_in_process_only(r, f"the re-check could not run: {other.skipped}"))
        elif not other.mismatches:
            out.append(_in_process_only(r, f"{other.cases} case(s) ran clean"))
        else:
            out.append(_confirmed(r, other))
    return out


def _in_process_only(r: RowResult, apart: str) -> RowResult:
    r.skipped = (f"{IN_PROCESS_ONLY}: {r.cause_name} ({r.detail}); with the relay in its own process, as deployed, "
                 f"{apart}")
    return r


def _confirmed(r: RowResult, other: RowResult) -> RowResult:
    """The re-check's row (the deployment's layout: a finding, or unconfirmed with its rate there), noting
    the in-process cause where it differed."""
    if other.cause_name != r.cause_name and other.detail is not None:
        other.detail += f" (with the relay in kvalign's process: {r.cause_name})"
    other.seconds += r.seconds
    return other


def unexplained(rows: Sequence[RowResult]) -> str | None:
    """The one line that ends ``check`` in exit 2 where a confirmed mismatch has no name: each such row
    with what it saw (kvalign's own model or harness is wrong there, not a finding to publish)."""
    bad = [r for r in rows if not r.skipped and r.mismatches and not r.unconfirmed
           and r.cause_name == Cause.UNKNOWN.name]
    if not bad:
        return None
    return ("kvalign could not name the mismatch of " + "; ".join(
        f"{r.prop}/{r.mode}/{r.variant}{'' if r.event_format in ('default', 'any') else f' [{r.event_format}]'}: "
        f"{r.detail}" for r in bad))

