"""``kvalign check``'s text report, made to fit a terminal of 100 columns.

A row's cause sentence, the configurations it is confined to and its shrunk counterexample are
each a line's worth or more; put in the table they made it 330 columns wide. So the table names a
cause by its short name (``HOST_CREDIT_NOT_SERVABLE``) and every cause is explained once, under
the table: what it means, which rows show it, where it holds (its scope) and the first such row's
shrunk counterexample. An n/a row's reason is said once there too. Every line is wrapped to
:data:`WIDTH`, whatever a router-hasher label or a counterexample holds; ``--json`` keeps each row
whole, so nothing is lost by the wrapping.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from kvalign.model.causes import CACHE_BLIND, CREDIT_SKEW
from kvalign.verify.engine.impact import advisories, blocking, row_class
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.engine.scope import Scope

#: The widest line ``check`` prints (stdout and stderr alike).
WIDTH = 100


def fit(text: str, indent: str = "  ") -> str:
    """``text`` wrapped to :data:`WIDTH` columns, continuation lines indented by ``indent``."""
    lead = text[: len(text) - len(text.lstrip(" "))]
    return "\n".join(textwrap.wrap(text, WIDTH, initial_indent="", subsequent_indent=lead + indent,
                                   break_long_words=True, break_on_hyphens=False, drop_whitespace=True)
                     if len(text) > WIDTH else [text])


def short_result(r: RowResult) -> str:
    """A row's ``result`` cell: ``ok``, ``n/a`` (it did not run, or no example exercised what it checks), or
    ``CLASS: CAUSE_NAME`` (``cache-blind``
    fails ``check``, ``credit-skew`` is an advisory; explained under the table, as are the causes a row
    counts apart, which never change its cell)."""
    if r.skipped:
        return "n/a"
    if r.unconfirmed:
        return f"unconfirmed: {r.cause_name or 'UNKNOWN'}"
    if not r.ok:
        return f"{row_class(r)}: {r.cause_name or 'UNKNOWN'}"
    return "ok"


def variant(r: RowResult) -> str:
    """The variant, and SGLang's KV-event format where it is not the default one (``check --event-format``)."""
    return r.variant + (f" [{r.event_format}]" if r.event_format not in ("default", "any") else "")


def row_name(r: RowResult) -> str:
    return f"{r.prop}/{r.mode}/{variant(r)}"


def progress_line(r: RowResult) -> str:
    """The stderr line for a finished row."""
    return fit(f"  {row_name(r)}: {short_result(r)} ({r.cases} cases, {r.seconds:.1f}s)")


def pages(page_size: int | None) -> str:
    return f"page size {page_size}" if page_size else "every page size the strategies draw"


def header(label: str, sglang: str, kind: str, dynamo: str, examples: int, page_size: int | None) -> str:
    sizes = f"page size {page_size}" if page_size else "every page size"
    return "\n".join([fit(f"kvalign check: SGLang {sglang} ({kind} cache) x Dynamo RadixTree {dynamo}"),
                      fit(f"  router hasher {label}; {examples} examples per row; {sizes}")])


def table(rows: Sequence[RowResult]) -> str:
    head = ("property", "mode", "variant", "cases", "mismatches", "result")
    body = [(r.prop, r.mode, variant(r), str(r.cases), str(r.mismatches), short_result(r)) for r in rows]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(tuple("-" * w for w in widths)), *map(line, body)])


def _names(rows: Sequence[RowResult]) -> str:
    return ", ".join(row_name(r) for r in rows)


def explanations(rows: Sequence[RowResult], page_size: int | None = None) -> str:
    """Each cause once (meaning, rows, scope, the first row's shrunk counterexample), then each skip reason once."""
    out: list[str] = []
    by_cause: dict[str, list[RowResult]] = {}
    for r in rows:
        if r.status == "finding":
            by_cause.setdefault(r.cause_name or "UNKNOWN", []).append(r)
    for name, group in by_cause.items():
        first = group[0]
        scopes = list(dict.fromkeys(r.condition for r in group if r.condition))
        scope = "; ".join(f"holds {c}" for c in scopes) if scopes else f"these rows, at {pages(page_size)}"
        out += ["", fit(f"{name} ({row_class(first)}): {first.cause or name}"),
                fit(f"  rows: {_names(group)}"),
                fit(f"  scope: {scope}"),
                fit(f"  counterexample ({row_name(first)})" + (f": {first.detail}" if first.detail else "")),
                fit(f"    shrunk: {first.counterexample}", indent="  ")]
        if first.admission:
            out.append(fit("    admitted request, as SGLang's scheduler reports it: "
                           + ", ".join(f"{k} {v}" for k, v in first.admission.items()), indent="  "))
        if first.impact and row_class(first) == CACHE_BLIND:  # a credit skew's impact is under the table
            out.append(fit(f"  routing impact (measured): {first.impact}"))
    out += _scoped(rows)
    out += [x for r in rows if r.status == "unconfirmed" for x in (
        "", fit(f"unconfirmed (not a finding) {row_name(r)}: {r.cause_name} {r.unconfirmed}: {r.detail}"))]
    skipped: dict[str, list[RowResult]] = {}
    for r in rows:
        if r.skipped:
            skipped.setdefault(r.skipped, []).append(r)
    for why, group in skipped.items():  # a row that ran and never exercised its subject says so, as one that did not run
        how = "never exercised" if any(r.cases for r in group) else "did not run"
        out += ["", fit(f"n/a ({how}) {_names(group)}: {why}")]
    out += [x for r in rows if r.not_checked and not r.skipped for x in ("", fit(f"partly checked {row_name(r)}: {r.not_checked}"))]
    if by_cause:
        out += ["", fit("(every row's cause, detail and counterexample, whole: kvalign check --json)")]
    return "\n".join(out)


def _scoped(rows: Sequence[RowResult]) -> list[str]:
    """Each cause counted apart from the mismatches once: what it is, how many cases, where it occurs."""
    out: list[str] = []
    by_name: dict[str, list[RowResult]] = {}
    for r in rows:
        for name in r.scoped or {}:
            by_name.setdefault(name, []).append(r)
    for name, group in by_name.items():
        first = group[0].scoped[name]
        n = sum(r.scoped[name]["cases"] for r in group)
        out += ["", fit(f"{name} (counted apart, not a mismatch): {first['cause']}"),
                fit(f"  {n} cases: " + ", ".join(f"{row_name(r)} {r.scoped[name]['cases']}" for r in group)),
                fit(f"  occurs {first['condition']}"),
                fit(f"  first case ({row_name(group[0])}): {first['detail']}")]
    return out


def apart(rows: Sequence[RowResult]) -> dict[str, int]:
    """Cases per cause counted apart from the mismatches (they never fail a row)."""
    totals: dict[str, int] = {}
    for r in rows:
        for name, e in (r.scoped or {}).items():
            totals[name] = totals.get(name, 0) + e["cases"]
    return totals


def advisory_lines(rows: Sequence[RowResult]) -> str:
    """Each credit-skew finding once, under the table: its bound and the real router's measured choice."""
    out: list[str] = []
    by_cause: dict[str, list[RowResult]] = {}
    for r in advisories(rows):
        by_cause.setdefault(r.cause_name or "UNKNOWN", []).append(r)
    for name, group in by_cause.items():
        out += ["", fit(f"advisory ({CREDIT_SKEW}, exit 0; --strict fails on it): {name} in {_names(group)}")]
        out += [fit(f"  {row_name(r)}: {r.impact or 'routing impact not measured'}") for r in group]
    return "\n".join(out)


def verdict(rows: Sequence[RowResult], seconds: float, strict: bool = False, scope: Scope | None = None) -> str:
    """The last lines: the verdict (``MISALIGNED`` only on cache-blind findings, or any finding with
    ``--strict``; ``INCONCLUSIVE``, never ``ALIGNED``, where a negative control did not fail: the run exits
    2) with what it speaks for (``scope``: ``ALIGNED for deployments without image prompts``, and the
    properties that did not run), then the configurations a cause is confined to (a reader deciding
    whether *their* deployment is affected needs that before the per-row details)."""
    failing, skews = blocking(rows, strict), advisories(rows)
    ran = [r for r in rows if not r.skipped]
    word = "MISALIGNED" if failing else "INCONCLUSIVE" if missed_controls(rows) else "ALIGNED"
    counts = (f"{sum(r.cases for r in rows)} cases in {seconds:.1f}s, "
              f"{sum(row_class(r) == CACHE_BLIND for r in rows)} of {len(ran)} rows {CACHE_BLIND}, "
              f"{len(skews)} {CREDIT_SKEW} (advisory{', failing with --strict' if strict and skews else ''})")
    na = len(rows) - len(ran)
    if na:
        counts += f", {na} n/a"
    unconfirmed = sum(r.status == "unconfirmed" for r in rows)
    if unconfirmed:
        counts += f", {unconfirmed} unconfirmed"
    partial = scope is not None and not scope.complete
    # an ALIGNED that left properties out says first what it is a verdict on, never a bare "ALIGNED: ..."
    head = [f"ALIGNED for {scope.aligned_for()}", f"  {counts}"] if word == "ALIGNED" and partial else [f"{word}: {counts}"]
    conditions = dict.fromkeys((r.cause_name, r.condition) for r in rows if r.status == "finding" and r.condition)
    not_run = scope.not_run_line() if partial else None
    return "\n".join([*(fit(ln) for ln in head), *([fit(f"  {not_run}")] if not_run else []),
                      *(fit(f"  {name} holds {condition}") for name, condition in conditions),
                      *(fit(f"  {name} counted apart in {n} cases (not a misalignment)") for name, n in apart(rows).items()),
                      *controls(rows)])


def missed_controls(rows: Sequence[RowResult]) -> list[RowResult]:
    """The rows whose negative control did not fail: a property that cannot fail on a deliberate
    misalignment proves nothing, so such a row's ``ok`` says nothing (``check`` exits 2)."""
    return [r for r in rows if r.control and not r.control["failed"]]


def controls(rows: Sequence[RowResult]) -> list[str]:
    """The rows that ran a negative control beside their search: how many failed as they must, and each
    that did not."""
    ran = [r for r in rows if r.control]
    if not ran:
        return []
    missed = missed_controls(ran)
    out = [fit(f"  negative controls: {len(ran) - len(missed)} of {len(ran)} failed as they must")]
    out += [fit(f"  control of {row_name(r)} did not fail ({r.control['mutation']}): got {r.control['cause']}, "
                f"expected {r.control['expected']}") for r in missed]
    return out
