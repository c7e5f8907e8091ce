"""bench/suite_times.py: the time map ranks tests by set-up + call + teardown and sums per marker."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("suite_times", ROOT / "bench" / "suite_times.py")
suite_times = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite_times)

DOC = {"markexpr": "not slow", "session_s": 9.0, "generated_cases": 7, "tests": {
    "tests/unit/a.py::fixture_heavy": {"setup": 5.0, "call": 0.5, "teardown": 0.1, "cpu": 4.0, "cases": 0,
                                       "markers": [], "outcome": "passed"},
    "tests/unit/a.py::long_call": {"setup": 0.0, "call": 3.0, "teardown": 0.0, "cpu": 1.0, "cases": 7,
                                   "markers": ["hypothesis", "slow"], "outcome": "passed"},
    "tests/unit/b.py::quick": {"setup": 0.0, "call": 0.2, "teardown": 0.0, "cpu": 0.2, "cases": 0,
                               "markers": ["slow"], "outcome": "skipped"},
}}


def test_top_tests_per_marker_and_per_file(tmp_path, capsys):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(DOC))
    assert suite_times.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 tests (2 passed, 1 skipped); 8.8 s in tests (5.2 s CPU, children included)")
    top = out.split("top 2 tests")[1].split("per marker")[0]
    assert top.index("fixture_heavy") < top.index("long_call") and "quick" not in top
    assert "   5.60    5.00    0.50    0.10    4.00      0  tests/unit/a.py::fixture_heavy" in top
    markers = out.split("per marker")[1].split("per file")[0]
    assert "     3.2 s      2 tests  slow" in markers and "     5.6 s      1 tests  (none)" in markers
    assert "     8.6 s     5.0 s      2 tests       7 cases  tests/unit/a.py" in out


def test_a_file_that_is_not_a_durations_file_is_exit_2(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text("[]")
    assert suite_times.main([str(path)]) == 2
    assert "not a --durations-json file" in capsys.readouterr().err


def test_split_durations_are_what_pytest_split_reads(tmp_path):
    """pytest-split's file maps test ids to seconds; a skipped test's near-zero figure would make
    its group look lighter than it is on a machine where it runs, so it is left out."""
    path, out = tmp_path / "d.json", tmp_path / "split.json"
    path.write_text(json.dumps(DOC))
    assert suite_times.main([str(path), "--split-durations", str(out)]) == 0
    assert json.loads(out.read_text()) == {"tests/unit/a.py::fixture_heavy": 5.6, "tests/unit/a.py::long_call": 3.0}


def test_per_worker_shows_busy_time_and_the_idle_tail(tmp_path, capsys):
    """The worker that ends last is the critical path; another worker's idle tail is what a better
    split could win."""
    doc = json.loads(json.dumps(DOC))
    doc["ended"] = 1000.0
    doc["tests"]["tests/unit/a.py::fixture_heavy"].update(worker="gw0", ended=990.0)
    doc["tests"]["tests/unit/a.py::long_call"].update(worker="gw0", ended=999.0)
    doc["tests"]["tests/unit/b.py::quick"].update(worker="gw1", ended=950.0)
    path = tmp_path / "d.json"
    path.write_text(json.dumps(doc))
    assert suite_times.main([str(path)]) == 0
    per_worker = capsys.readouterr().out.split("per worker")[1]
    assert "     8.6 s busy     1.0 s idle at the end     2 tests  gw0" in per_worker
    assert "     0.2 s busy    50.0 s idle at the end     1 tests  gw1" in per_worker
