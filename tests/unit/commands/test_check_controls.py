"""A negative control that does not fail makes ``kvalign check`` exit 2, naming the control and its row.

A property that passes a deliberate misalignment would pass a real one too, so a row whose control
did not fail proves nothing: the run cannot say "aligned" (exit 0) nor "misaligned" (exit 1) for it.
The systems and rows are stand-ins here (the rows as a hybrid run would give them), so the test
holds the command's verdict and exit code, not the property; the real controls are held in
tests/unit/verify/props/hybrid/test_hybrid.py and test_storage.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvalign.cli import main
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.engine.systems import Facts

CAUGHT = {"mutation": "drop_removals", "cases": 4, "failed": True, "cause": "INGEST_STALE", "expected": "INGEST_STALE"}
MISSED = {**CAUGHT, "failed": False, "cause": None}


class _Systems:
    def close(self) -> None:
        pass


def _check(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], controls: list[dict[str, Any]],
           *argv: str) -> tuple[int, str, str]:
    """``kvalign check --property hybrid`` whose rows carry ``controls``, through the real command line."""
    import kvalign.commands.check as check

    rows = [RowResult("hybrid", "plain", variant, 4, 0, 0.1, control=c) for variant, c in zip(("swa", "mamba"), controls)]
    monkeypatch.setattr(check, "open_systems", lambda spec: (_Systems(), Facts("0.5.23", "1.6.1", "unified", True)))
    monkeypatch.setattr(check, "run_jobs", lambda jobs, systems, opts, progress: rows)
    rc = main(["check", "--property", "hybrid", "--mode", "plain", "--jobs", "1", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_control_that_did_not_fail_exits_2_naming_it_and_its_row(monkeypatch, capsys):
    rc, out, err = _check(monkeypatch, capsys, [CAUGHT, MISSED])
    assert rc == 2, out
    [line] = err.splitlines()
    assert line.startswith("kvalign: error: ") and "hybrid/plain/mamba" in line and "drop_removals" in line
    assert "hybrid/plain/swa" not in line and "Traceback" not in err
    assert "control of hybrid/plain/mamba did not fail" in out  # the report is still printed, above the error
    assert "\nINCONCLUSIVE: 8 cases" in out and "ALIGNED" not in out


def test_in_json_too(monkeypatch, capsys):
    rc, out, err = _check(monkeypatch, capsys, [CAUGHT, MISSED], "--json")
    report = json.loads(out)
    assert rc == 2 and report["exit"] == 2
    assert "hybrid/plain/mamba" in report["error"] and "drop_removals" in report["error"]
    assert len(err.splitlines()) == 1 and "hybrid/plain/mamba" in err


def test_controls_that_failed_as_they_must_leave_the_verdict_alone(monkeypatch, capsys):
    rc, out, err = _check(monkeypatch, capsys, [CAUGHT, CAUGHT], "--json")
    report = json.loads(out)
    assert rc == 0 and report["exit"] == 0 and report["error"] is None and err == ""
