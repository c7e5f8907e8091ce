"""A storage write that outlasts the pump's timeout is an environment error (exit 2), never a finding.

SGLang's storage writes run on its backup thread; on a loaded machine they can outlast
:data:`kvalign.oracles.storage.PUMP_TIMEOUT_S`. That says the machine is slow, not that the router
and SGLang disagree, so it must not become a ``PATH_UNAVAILABLE`` row (cache-blind, exit 1). The
engine and router path are stand-ins here: no real one can be made to time out on cue, and what is
held is what kvalign does with the timeout (raise, stop the search at once, say it in one line).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvalign.cli import main
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.props.storage.body import StorageRun, StorageScenario, run_storage_rows, storage_scenarios
from kvalign.verify.engine.systems import Facts

SCENARIO = StorageScenario(page_size=2, eagle=False, prompts=[[0, 1, 2, 3, 0]])


class _SlowEngine:
    """A storage engine whose writes never finish within the pump's timeout."""

    made = 0

    def __init__(self, page_size: int, *, eagle: bool) -> None:
        type(self).made += 1
        self.page_size = page_size

    def take_raw_events(self) -> list[Any]:
        return []

    def insert(self, tokens: list[int], lora: str | None, salt: str | None) -> None:
        pass

    def storage_keys(self, tokens: list[int], lora: str | None, salt: str | None) -> list[str]:
        return [f"page-{i}" for i in range(len(tokens) // self.page_size)]

    def pump(self, until: Callable[[], bool] | None = None) -> bool:
        return False

    def stored_files(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


class _Path:
    """The tier path, as far as a storage example uses it before its first write: a worker, a settle."""

    def worker(self, page_size: int, eagle: bool) -> tuple[Any, None]:
        return type("Worker", (), {"token_space": lambda self: 0})(), None

    def settle(self, worker: Any, tap: None) -> None:
        return None

    def close(self) -> None:
        pass


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> type[_SlowEngine]:
    monkeypatch.setattr(_SlowEngine, "made", 0)
    return _SlowEngine


def test_a_storage_write_timeout_is_an_environment_error_not_a_mismatch(slow):
    with pytest.raises(OracleUnavailable, match=r"storage writes did not finish within 10 s \(0 of 2 page"):
        StorageRun(_Path(), False, "base", make_engine=slow)(SCENARIO)


def test_the_search_stops_at_the_first_environment_error(slow):
    """Neither a row nor a shrink: each replay would sit out the same timeout, and a timeout that did not
    recur would be Hypothesis's flaky-test error (a traceback) instead of the one line."""
    from kvalign.verify.engine.search import run_search

    with pytest.raises(OracleUnavailable, match="storage writes did not finish"):
        run_search(StorageRun(_Path(), False, "base", make_engine=slow), storage_scenarios(False), 8)
    assert slow.made == 1


def test_check_exits_2_in_one_line_naming_it(slow, monkeypatch, capsys):
    """``kvalign check --property storage`` through the real command, rows and search; only the engine, the
    router path and the systems stand in."""
    import kvalign.commands.check as check
    import kvalign.oracles.storage as storage_oracle
    import kvalign.standins.hicache_storage as standin
    import kvalign.verify.props.tier.body as tier

    systems = type("Systems", (), {"router_path": lambda self: _Path(), "close": lambda self: None})()
    monkeypatch.setattr(storage_oracle, "StorageEngine", slow)
    monkeypatch.setattr(standin, "version_problem", lambda version: None)
    monkeypatch.setattr(tier, "TierPath", lambda path: path)
    monkeypatch.setattr(check, "open_systems", lambda spec: (systems, Facts("0.5.23", "1.6.1", "unified", True)))

    def run_jobs(jobs: Any, systems: Any, opts: Any, progress: Any) -> list[RowResult]:
        return run_storage_rows(systems, ("plain",), ("base",), 4)

    monkeypatch.setattr(check, "run_jobs", run_jobs)
    rc = main(["check", "--property", "storage", "--mode", "plain", "--jobs", "1", "--json"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, (out, err)
    assert err.startswith("kvalign: error: SGLang's storage writes did not finish within 10 s") and "Traceback" not in err
