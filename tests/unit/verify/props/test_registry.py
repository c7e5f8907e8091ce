"""The registry: a property is one folder under ``kvalign/verify/props/`` and one line in ``HOMES``.

The toy property (tests/unit/verify/props/homes/toy/: registration, body, strategies, negative
control) is registered exactly as a new property would be, its name added to ``HOMES``, with its
folder put on ``kvalign.verify.props``'s path instead of copied into it; ``check`` then runs it
through the engine with nothing else changed, and its own negative control fails it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvalign.cli import main
from kvalign.verify import props

HOMES_DIR = Path(__file__).resolve().parent / "homes"


@pytest.fixture
def toy(monkeypatch):
    """The toy's folder on the package's path and ``"toy"`` in ``HOMES``: the registry ``check`` reads, rebuilt."""
    monkeypatch.setattr(props, "__path__", [*props.__path__, str(HOMES_DIR)])
    monkeypatch.setattr(props, "HOMES", (*props.HOMES, "toy"))
    saved = list(props.REGISTRY)
    props.REGISTRY[:] = props.load(props.HOMES)
    try:
        yield props.by_name()["toy"]
    finally:
        props.REGISTRY[:] = saved
        for name in [m for m in sys.modules if m == "kvalign.verify.props.toy" or m.startswith("kvalign.verify.props.toy.")]:
            del sys.modules[name]
        monkeypatch.delattr(props, "toy", raising=False)


def _row(capsys) -> dict:
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    return row


def test_every_home_registers_its_property_under_its_own_name():
    assert [p.name for p in props.REGISTRY] == list(props.HOMES)


def test_a_toy_property_in_one_folder_and_one_registry_line_runs_through_check(toy, capsys, router_hasher, sglang_available):
    assert toy.name in props.names()  # --property's choices and --toy-examples are built from the registry
    rc = main(["check", "--property", "toy", "--jobs", "1", "--json", "--toy-examples", "20"])
    row = _row(capsys)
    assert rc == 0 and (row["prop"], row["mode"], row["variant"], row["status"]) == ("toy", "plain", "base", "ok"), row
    assert 0 < row["cases"] <= 20 and row["event_format"] == "any"


def test_negative_control_the_toys_own_control_fails_it(toy, capsys, router_hasher, sglang_available):
    rc = main(["check", "--property", "toy", "--jobs", "1", "--json", "--toy-examples", "20",
               "--router-hash", "kvalign.verify.props.toy.controls:length_salted"])
    row = _row(capsys)
    assert rc == 1 and row["status"] == "finding" and row["mismatches"] > 0, row
    assert "hash differently alone" in row["detail"] and row["counterexample"]["cut"] >= 1

