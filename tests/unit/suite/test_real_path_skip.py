"""Real-path tests that cannot start the router path: a skip here, a failure under ``KVALIGN_REQUIRE_REAL_PATHS=1``.

Where CI's set-up installed Dynamo's runtime, a router path that cannot start is a broken
environment, and a run whose real-path tests all skipped would pass having checked nothing. Under
the switch (``.ci/run`` sets it) such a test fails, naming why the path could not start, as a GPU
test does under ``KVALIGN_REQUIRE_GPU`` (tests/gpu_skip.py).
"""

from __future__ import annotations

import pytest

import kvalign.oracles.router_path as router_path
from kvalign.oracles.base import OracleUnavailable

SWITCH = "KVALIGN_REQUIRE_REAL_PATHS"


def _outcome(monkeypatch: pytest.MonkeyPatch, switch: str | None) -> BaseException:
    """What ``open_router_path`` raises when the path cannot start, with the switch at ``switch`` (None: unset)."""
    from router_paths import open_router_path

    def refuse(*args: object) -> None:
        raise OracleUnavailable("no Dynamo runtime here")

    monkeypatch.setattr(router_path, "RouterPath", refuse)
    if switch is None:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, switch)
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as raised:
        open_router_path("real Dynamo router path unavailable")
    return raised.value


def test_under_the_switch_a_path_that_cannot_start_fails_naming_why(monkeypatch):
    outcome = _outcome(monkeypatch, "1")
    assert isinstance(outcome, pytest.fail.Exception), outcome
    assert str(outcome) == ("KVALIGN_REQUIRE_REAL_PATHS=1, but the real router path cannot start: "
                            "real Dynamo router path unavailable: no Dynamo runtime here")


@pytest.mark.parametrize("switch", [None, "0"])
def test_elsewhere_it_stays_a_skip(monkeypatch, switch):
    outcome = _outcome(monkeypatch, switch)
    assert isinstance(outcome, pytest.skip.Exception)
    assert str(outcome) == "real Dynamo router path unavailable: no Dynamo runtime here"
