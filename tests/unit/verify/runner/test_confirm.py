"""A finding reproduces before it is published (issue 46): :mod:`kvalign.verify.runner.confirm`'s one rule.

Each test breaks exactly one leg: a path that could not start published as a cause, an in-process-only
mismatch published, a reproduced one dropped, an unnamed one published, an unconfirmed one failing the
run or the pair.
"""

from __future__ import annotations

from kvalign.model.causes import Cause
from kvalign.verify.runner.confirm import IN_PROCESS_ONLY, confirm_rows, unexplained
from kvalign.verify.engine.impact import blocking
from kvalign.verify.report.matrix import pair_result, result_from_row
from kvalign.verify.engine.rows import RowResult, row_json


def finding(cause: Cause, detail: str = "seen", prop: str = "ingest", variant: str = "base") -> RowResult:
    return RowResult(prop, "plain", variant, 3, 1, 1.0, cause.value, cause.name, detail)


def no_rerun() -> list[RowResult]:
    raise AssertionError("re-checked a row that needed no re-check")


def test_a_path_that_could_not_start_is_n_a_with_what_it_saw_never_a_cause():
    rows = confirm_rows([finding(Cause.PATH_UNAVAILABLE, "Dynamo 1.0.2 cannot start a worker relay")],
                        path_used=False, rerun=no_rerun)
    assert rows[0].status == "n/a" and rows[0].cause_name is None and not blocking(rows)
    assert rows[0].skipped == "the path could not run here: Dynamo 1.0.2 cannot start a worker relay"


def test_an_in_process_path_that_could_not_run_is_run_with_the_relay_apart_first():
    stopped = lambda: finding(Cause.PATH_UNAVAILABLE, "the relay never indexed a plain one-page SGLang event")  # noqa: E731
    rows = confirm_rows([stopped()], path_used=True, rerun=lambda: [finding(Cause.TIER_MISFILED, "host as device")])
    assert rows[0].status == "finding" and rows[0].cause_name == "TIER_MISFILED"
    rows = confirm_rows([stopped()], path_used=True, rerun=lambda: [RowResult("ingest", "plain", "base", 9, 0)])
    assert rows[0].status == "n/a" and rows[0].skipped.startswith(IN_PROCESS_ONLY)
    rows = confirm_rows([stopped()], path_used=True, rerun=lambda: [stopped()])
    assert rows[0].status == "n/a" and not rows[0].skipped.startswith(IN_PROCESS_ONLY)  # both layouts: the environment
    assert rows[0].skipped == ("the path could not run here: the relay never indexed a plain one-page SGLang event; "
                               "with the relay in its own process too (the path could not run here: the relay never "
                               "indexed a plain one-page SGLang event)")


def test_a_finding_only_the_in_process_relay_shows_is_n_a_and_says_so():
    rows = confirm_rows([finding(Cause.EVENTS_DROPPED, "the relay stopped indexing")], path_used=True,
                        rerun=lambda: [RowResult("ingest", "plain", "base", 25, 0, 2.0)])
    assert rows[0].status == "n/a" and not blocking(rows)
    assert rows[0].skipped.startswith(IN_PROCESS_ONLY) and "EVENTS_DROPPED (the relay stopped indexing)" in rows[0].skipped
    assert "25 case(s) ran clean" in rows[0].skipped


def test_a_finding_the_relay_in_its_own_process_reproduces_is_published_as_that_run_shows_it():
    apart = finding(Cause.TENANTS_SHARE_KEYS, "indexed without its cache_salt", variant="namespace")
    rows = confirm_rows([finding(Cause.EVENTS_DROPPED, variant="namespace"), finding(Cause.NAMESPACE_DROPPED)],
                        path_used=True, rerun=lambda: [apart, finding(Cause.NAMESPACE_DROPPED)])
    assert [r.cause_name for r in rows] == ["TENANTS_SHARE_KEYS", "NAMESPACE_DROPPED"]
    assert rows[0].detail.endswith("(with the relay in kvalign's process: EVENTS_DROPPED)")
    assert len(blocking(rows)) == 2


def test_a_re_check_that_cannot_start_confirms_nothing():
    rows = confirm_rows([finding(Cause.EVENTS_DROPPED)], path_used=True,
                        rerun=lambda: [finding(Cause.PATH_UNAVAILABLE, "the relay's own process did not start")])
    assert rows[0].status == "n/a" and "the relay's own process did not start" in rows[0].skipped


def test_rows_that_never_reached_the_relay_and_skews_are_not_re_checked():
    skew = finding(Cause.HOST_CREDIT_NOT_SERVABLE, prop="servable")
    assert confirm_rows([finding(Cause.ROUTER_EAGLE_OFF, prop="hash")], path_used=False, rerun=no_rerun)[0].status == "finding"
    assert confirm_rows([skew], path_used=True, rerun=no_rerun) == [skew]
    assert confirm_rows([RowResult("ingest", "plain", "base", 25, 0)], path_used=True, rerun=no_rerun)[0].ok


def test_an_unconfirmed_mismatch_fails_nothing_and_is_kept_apart_in_the_matrix():
    row = finding(Cause.INGEST_STALE, "the router still holds 1 block(s) SGLang removed or cleared")
    row.unconfirmed = "recurred in 3 of 10 replays of its example"
    assert confirm_rows([row], path_used=False, rerun=no_rerun)[0].status == "unconfirmed"
    assert not blocking([row]) and not blocking([row], strict=True)
    data = row_json(row)
    assert data["status"] == "unconfirmed"
    pair = pair_result("1.0.2", "0.5.23", {"rows": [data], "event_formats": ["default"]})
    assert pair.verdict == "aligned" and pair.findings == []
    assert pair.unconfirmed == [{"property": "ingest", "mode": "plain", "variant": "base", "cause": "INGEST_STALE",
                                 "detail": row.detail, "rate": "recurred in 3 of 10 replays of its example"}]
    assert result_from_row(pair.as_json()).unconfirmed == pair.unconfirmed


def test_a_confirmed_mismatch_kvalign_cannot_name_is_an_error_line_never_a_cause():
    row = finding(Cause.UNKNOWN, "SGLang reuses 2 pages, kvalign predicts 1, the router answers 1")
    line = unexplained([row, finding(Cause.NAMESPACE_DROPPED)])
    assert line == ("kvalign could not name the mismatch of ingest/plain/base: SGLang reuses 2 pages, kvalign "
                    "predicts 1, the router answers 1")
    row.unconfirmed = "recurred in 1 of 10 replays of its example"
    assert unexplained([row]) is None


class _Path:
    def __init__(self, apart: bool) -> None:
        self.apart, self.closed = apart, False

    def close(self) -> None:
        self.closed = True


class _Relayed:
    """A property whose rows run through the router path and fail only where its relay is in-process."""

    name, modes, default, events, budget = "ingest", ("plain",), True, "each", None

    def run(self, job, systems, opts):
        path = systems.router_path()
        if path.apart:
            return [RowResult("ingest", "plain", "base", 5, 0, 1.0)]
        return [finding(Cause.EVENTS_DROPPED, "the relay stopped indexing")]


def test_check_re_checks_a_relayed_finding_with_the_relay_apart_and_closes_that_path(monkeypatch):
    import kvalign.oracles.relay_process as relay_process
    from kvalign.verify.runner import check
    from kvalign.verify.engine.property import Job, Options
    from kvalign.verify.engine.systems import Systems

    opened: list[_Path] = []
    monkeypatch.setattr(relay_process, "ProcessRouterPath", lambda transform=None: opened.append(_Path(True)) or opened[-1])
    monkeypatch.setattr(check, "by_name", lambda: {"ingest": _Relayed()})
    in_process = _Path(False)
    systems = Systems(None, None, None, open_router_path=lambda: in_process)  # type: ignore[arg-type]
    rows = [row for k in range(2) for row in check.run_job(k, Job("ingest", ("plain",)), systems, Options())]
    assert [r.status for r in rows] == ["n/a", "n/a"] and rows[0].skipped.startswith(IN_PROCESS_ONLY)
    assert len(opened) == 1  # one relay-apart path for the run, shared by every re-check
    systems.close()
    assert opened[0].closed and in_process.closed


def test_an_in_process_unconfirmed_mismatch_is_what_the_relay_apart_shows():
    """Where the in-process relay stops varies by run, so a mismatch that recurred in some of its replays
    there is re-checked like a finding: clean apart -> n/a in-process only; unconfirmed apart -> that row
    with its rate there; recurring apart -> the finding."""
    def seen() -> RowResult:
        row = finding(Cause.EVENTS_DROPPED, "the relay stopped indexing")
        row.unconfirmed = "recurred in 9 of 10 replays of its example"
        return row

    clean = confirm_rows([seen()], path_used=True, rerun=lambda: [RowResult("ingest", "plain", "base", 20, 0)])[0]
    assert clean.status == "n/a" and clean.skipped.startswith(IN_PROCESS_ONLY) and "20 case(s) ran clean" in clean.skipped
    apart = finding(Cause.INGEST_STALE, "held a removed block")
    apart.unconfirmed = "recurred in 2 of 10 replays of its example"
    row = confirm_rows([seen()], path_used=True, rerun=lambda: [apart])[0]
    assert row.status == "unconfirmed" and row.unconfirmed == apart.unconfirmed and row.cause_name == "INGEST_STALE"
    assert row.detail.endswith("(with the relay in kvalign's process: EVENTS_DROPPED)")
    row = confirm_rows([seen()], path_used=True, rerun=lambda: [finding(Cause.TENANTS_SHARE_KEYS)])[0]
    assert row.status == "finding" and row.cause_name == "TENANTS_SHARE_KEYS" and blocking([row])


class _StaleApart(_Relayed):
    """As :class:`_Relayed`, but the first relay-apart path cannot run the row (a stale router state);
    a fresh one runs it clean."""

    def run(self, job, systems, opts):
        path = systems.router_path()
        if path.apart and path.stale:
            return [finding(Cause.PATH_UNAVAILABLE, "one worker per router expected, get_overlap_scores answered 2")]
        return super().run(job, systems, opts)


def test_a_re_check_that_could_not_run_on_the_shared_path_runs_once_more_on_a_fresh_one(monkeypatch):
    """The control is the first path alone: its row would be n/a 'the re-check could not run'."""
    import kvalign.oracles.relay_process as relay_process
    from kvalign.verify.runner import check
    from kvalign.verify.engine.property import Job, Options
    from kvalign.verify.engine.systems import Systems

    opened: list[_Path] = []

    def open_apart(transform=None):
        opened.append(_Path(True))
        opened[-1].stale = len(opened) == 1
        return opened[-1]

    monkeypatch.setattr(relay_process, "ProcessRouterPath", open_apart)
    monkeypatch.setattr(check, "by_name", lambda: {"ingest": _StaleApart()})
    systems = Systems(None, None, None, open_router_path=lambda: _Path(False))  # type: ignore[arg-type]
    [row] = check.run_job(0, Job("ingest", ("plain",)), systems, Options())
    assert row.status == "n/a" and row.skipped.startswith(IN_PROCESS_ONLY) and "5 case(s) ran clean" in row.skipped
    assert len(opened) == 2 and opened[0].closed and not opened[1].closed
    systems.close()
    assert opened[1].closed
