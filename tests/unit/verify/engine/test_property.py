"""The property interface: a property is one module behind :mod:`kvalign.verify.engine.property` plus a registry line.

A toy property, registered here and nowhere else, shows up in ``check``'s text table, its ``--json``
rows, ``matrix``'s table and ``--markdown``; ``kvalign/verify/runner/check.py`` names no property; and
docs/check.md lists the registered properties in the registry's order.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from hypothesis import strategies as st

from kvalign.cli import main
from kvalign.model.causes import Cause
from kvalign.verify.report import matrix
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.engine.property import Budget, Options, SearchProperty
from kvalign.verify.props import REGISTRY

ROOT = Path(__file__).resolve().parents[4]


def _toy_body(_systems: object):
    def body(n: int) -> None:
        if n >= 5:  # the toy's "misalignment": any number from 5 up; Hypothesis shrinks it to 5
            raise Mismatch("toy", f"{n} is 5 or more", Cause.SEED_DRIFT, n)
    return body


TOY = SearchProperty("toy", body=_toy_body, strategy=lambda _mode, _variant, _page: st.integers(0, 9), modes=("plain",),
                     variants=("base",), events="none", budget=Budget("toy", 30, "cap on toy cases"))


@pytest.fixture
def toy():
    REGISTRY.append(TOY)
    try:
        yield TOY
    finally:
        REGISTRY.remove(TOY)


def test_a_registered_toy_property_is_in_every_output(toy, capsys, router_hasher, sglang_available):
    rc = main(["check", "--property", "toy", "--json", "--toy-examples", "20"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and [(r["prop"], r["mode"], r["variant"]) for r in report["rows"]] == [("toy", "plain", "base")]
    (row,) = report["rows"]
    assert row["cause_name"] == "SEED_DRIFT" and row["counterexample"] == 5 and row["event_format"] == "any"
    assert row["cases"] <= 20  # its own budget option, --toy-examples, made from the registry

    rc = main(["check", "--property", "toy"])
    out = capsys.readouterr().out
    assert rc == 1 and re.search(r"^toy +plain +base +\d+ +\d+ +(MISALIGNED|cache-blind): SEED_DRIFT$", out, re.M), out
    assert "counterexample (toy/plain/base): 5 is 5 or more" in out and "shrunk: 5" in out

    pair = matrix.pair_result("1.6.1", "0.5.23", report)
    assert pair.findings[0]["property"] == "toy"
    assert "| toy:plain |" in matrix.table([pair], ["card", "toy"]).splitlines()[0].replace("  ", " ").replace("  ", " ")
    markdown = matrix.render_markdown([pair], "kvalign matrix --property toy --markdown")
    assert "| misaligned | SEED_DRIFT (toy) |" in markdown
    assert toy.name in matrix.report_json([pair], {}, None)["properties"]  # a default property: in the matrix's list


def test_a_property_not_registered_is_refused(capsys):
    assert main(["check", "--property", "toy"]) == 2
    assert "invalid choice: 'toy'" in capsys.readouterr().err


def test_the_check_engine_names_no_property():
    """Every name the registry holds is absent from the engine's string constants: no per-property branch."""
    names = {p.name for p in REGISTRY}
    for module in ("kvalign/verify/runner/check.py", "kvalign/commands/check.py", "kvalign/commands/check_text.py"):
        tree = ast.parse((ROOT / module).read_text())
        said = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not names & said, f"{module} names {sorted(names & said)}"


def test_docs_list_the_registered_properties_in_registry_order():
    text = (ROOT / "docs/check.md").read_text()
    listed = re.findall(r"^- \*\*([a-z_]+)\*\*", text.split("### ", 1)[0], re.M)
    assert listed == [p.name for p in REGISTRY]


def test_a_budget_caps_the_examples_it_is_given():
    budget = Budget("x", 25, "")
    assert Options(examples=200).examples_for(budget) == 25
    assert Options(examples=10).examples_for(budget) == 10
    assert Options(examples=200, caps=(("x", 40),)).examples_for(budget) == 40
    assert Options(examples=200).examples_for(None) == 200


def test_jobs_are_planned_in_display_order_with_each_format_once_for_format_blind_properties():
    from kvalign.verify.runner.check import plan, selected

    opts = Options(examples=50)
    jobs = plan(selected(["pages", "hash", "card"]), ("default", "dynamo"), opts)
    assert [j.prop for j in jobs][:1] == ["card"] and jobs[1].prop == "hash"
    assert {(j.prop, j.event_format) for j in jobs} == {("card", "default"), ("hash", "default"),
                                                         ("pages", "default"), ("pages", "dynamo")}
    skipped = plan(selected(["pages"]), ("default", "dynamo"), opts, format_missing=lambda f: "no" if f == "dynamo" else None)
    assert [(j.event_format, j.skipped) for j in skipped][-1] == ("dynamo", "no")
