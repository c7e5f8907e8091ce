"""``kvalign matrix --list-cells`` / ``--cell`` / ``--merge`` and the nightly workflow that fans them out.

The merge must give the table and JSON of one run over the same pairs: ``merge_cells`` orders the
rows as one run does and the text and JSON come from the same functions (``render``,
``report_json``) a run prints with. The in-process tests stub the per-pair check (``run_pair``) so
that several pairs, a misaligned one, an error and an unknown shipped pin cost nothing; the ``slow``
test runs the environment's own pair for real, once as a run and once as a cell (the session's
``installed_cell``, whose row test_local_build.py reads too), and merges it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvalign.commands.matrix as matrix_cmd
import kvalign.verify.report.matrix as matrix
from kvalign.cli import main
from kvalign.verify.report.matrix import CELL_FORMAT, MatrixError, PairResult

ROOT = Path(__file__).resolve().parents[4]
WORKFLOW = ROOT / ".github" / "workflows" / "kvalign-nightly.yml"

pytestmark = pytest.mark.usefixtures("cli_parser")  # main() runs 77 times in this module

# ---- stubbed pairs: several cells, no child process ------------------------------------------------

PINS = {"1.6.1": "0.5.21", "1.0.2": "0.5.9"}
FINDING = {"property": "ingest", "mode": "eagle", "variant": "lora", "cause": "LORA_NOT_IN_EVENTS", "detail": "d"}


def _fake_pair(dynamo: str, sglang: str, *, examples: int, ingest_examples: int, props=None, log=None,
               event_format: str = "both") -> PairResult:
    if props and "ingest" not in props:  # a run narrowed to other properties cannot see the ingest finding
        return PairResult(dynamo, sglang, "aligned", seconds=1.0)
    if sglang == "0.5.19":
        return PairResult(dynamo, sglang, "misaligned", [dict(FINDING)], seconds=1.0)
    if dynamo == "1.0.2" and sglang == "0.5.9":
        return PairResult(dynamo, sglang, "error", error="Traceback...\ncannot import SGLang's radix cache", seconds=1.0)
    return PairResult(dynamo, sglang, "aligned", seconds=1.0)


def _pin(dynamo: str, log=None) -> str | None:
    if dynamo == "1.3.1":
        raise MatrixError("cannot install ai-dynamo-runtime==1.3.1: no such version")
    return PINS.get(dynamo)


@pytest.fixture
def stubbed(monkeypatch):
    monkeypatch.setattr(matrix, "run_pair", _fake_pair)
    monkeypatch.setattr(matrix, "ensure_release", lambda kind, version, log=None: None)
    monkeypatch.setattr(matrix_cmd, "shipped_sglang", _pin)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["matrix", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# --dynamo out of version order: a merge must keep one run's order, not sort it.
OPTIONS = ["--dynamo", "1.6.1,1.3.1,1.0.2", "--sglang", "0.5.23,0.5.19", "--shipped", "--examples", "1",
           "--ingest-examples", "1"]


def _cells_one_by_one(capsys, tmp_path: Path, options: list[str]) -> list[str]:
    code, out, _ = _run(capsys, *options, "--list-cells", "--json")
    assert code == 0
    cells = json.loads(out)
    files = []
    for i, c in enumerate(reversed(cells)):  # any order: the merge orders the rows
        assert set(c) >= {"cell", "dynamo", "sglang", "shipped"} and c["cell"] == f"{c['dynamo']}:{c['sglang']}"
        code, out, _ = _run(capsys, *options, "--cell", c["cell"], "--json")
        doc = json.loads(out)
        assert doc["format"] == CELL_FORMAT and len(doc["rows"]) == 1 and code == matrix.exit_code(
            [matrix.result_from_row(doc["rows"][0])])
        path = tmp_path / f"cell-{i}.json"
        path.write_text(out)
        files.append(str(path))
    return files


def test_list_cells_are_the_pairs_one_run_checks(stubbed, capsys):
    code, out, _ = _run(capsys, *OPTIONS, "--list-cells", "--json")
    assert code == 0
    cells = json.loads(out)
    assert [c["cell"] for c in cells] == ["1.6.1:0.5.19", "1.6.1:0.5.21", "1.6.1:0.5.23", "1.3.1:0.5.19",
                                          "1.3.1:0.5.23", "1.0.2:0.5.9", "1.0.2:0.5.19", "1.0.2:0.5.23",
                                          "1.3.1:unknown"]
    assert [c["shipped"] for c in cells] == [False, True, False, False, False, True, False, False, True]
    assert "1.3.1" in cells[-1]["error"]
    code, out, _ = _run(capsys, *OPTIONS, "--list-cells")
    assert out.split() == [c["cell"] for c in cells]


def test_merged_cells_print_one_run_s_table_and_json(stubbed, capsys, tmp_path, monkeypatch):
    code, table_one, _ = _run(capsys, *OPTIONS)
    code_json, json_one, _ = _run(capsys, *OPTIONS, "--json")
    assert code == code_json == 2  # an error row (1.0.2's shipped SGLang, 1.3.1's unknown pin)
    files = _cells_one_by_one(capsys, tmp_path, OPTIONS)
    before = {f: Path(f).read_bytes() for f in files}
    merged_code, table_merged, err = _run(capsys, "--merge", *files)
    assert (merged_code, table_merged) == (code, table_one)
    assert "merged 9 cells" in err
    merged_code, json_merged, _ = _run(capsys, "--merge", *files, "--json")
    assert merged_code == code and json.loads(json_merged) == json.loads(json_one)
    assert {f: Path(f).read_bytes() for f in files} == before  # the inputs are only read


def test_merge_of_some_cells_is_one_run_over_those_pairs(stubbed, capsys, tmp_path):
    options = ["--dynamo", "1.6.1", "--sglang", "0.5.23,0.5.19", "--examples", "1", "--ingest-examples", "1"]
    files = _cells_one_by_one(capsys, tmp_path, options)
    code, one, _ = _run(capsys, *options)
    assert _run(capsys, "--merge", *files)[:2] == (code, one) and code == 1


def test_property_narrows_every_pair_its_columns_and_its_cells(stubbed, capsys, tmp_path, monkeypatch):
    options = ["--dynamo", "1.6.1", "--sglang", "0.5.19,0.5.23", "--examples", "1", "--ingest-examples", "1"]
    seen = []
    monkeypatch.setattr(matrix, "run_pair", lambda *a, props=None, **kw: seen.append(props) or _fake_pair(*a, props=props, **kw))
    code, out, _ = _run(capsys, *options, "--property", "card", "--property", "hash")
    head = out.splitlines()[0]
    assert code == 0 and seen == [["card", "hash"]] * 2 and "card:eagle" in head and "hash:plain" in head
    assert "ingest" not in head and "tier" not in head  # no column claims a property that did not run
    code, out, _ = _run(capsys, *options, "--property", "ingest", "--json")
    assert code == 1 and json.loads(out)["properties"] == ["ingest"]  # the finding is back with its property
    narrowed = _cells_one_by_one(capsys, tmp_path, [*options, "--property", "card"])
    assert _run(capsys, "--merge", *narrowed)[:2] == _run(capsys, *options, "--property", "card")[:2]
    (tmp_path / "whole").mkdir()
    whole = _cells_one_by_one(capsys, tmp_path / "whole", options)
    code, _, err = _run(capsys, "--merge", narrowed[0], whole[1])  # two different cells, two plans
    assert code == 2 and "mismatched cell" in err  # a narrowed cell never merges into a whole run


def _planned(capsys, tmp_path: Path, options: list[str]) -> str:
    code, out, _ = _run(capsys, *options, "--list-cells", "--json")
    assert code == 0
    return _write(tmp_path, "cells.json", out)


def test_merge_held_to_the_planned_cells_names_every_missing_cell_and_exits_2(stubbed, capsys, tmp_path):
    """A dead cell job leaves no result: with --cells the merged table still has its row (an error),
    the last stderr line names every missing cell, and the exit is 2, never 0 or 1 with a row short."""
    options = ["--dynamo", "1.6.1", "--sglang", "0.5.23,0.5.19", "--shipped", "--examples", "1",
               "--ingest-examples", "1"]
    cells = _planned(capsys, tmp_path, options)
    files = _cells_one_by_one(capsys, tmp_path, options)  # 1.6.1:0.5.19, :0.5.21 (shipped), :0.5.23, reversed
    code, whole, _ = _run(capsys, *options)
    # every planned cell has its result: exactly the one run's table and exit, whatever the argument order
    for argv in (["--merge", "--cells", cells, *files], ["--merge", *files, "--cells", cells]):
        assert _run(capsys, *argv)[:2] == (code, whole) and code == 1
    # two of the three results lost (the shipped 0.5.21 and 0.5.23): named, in the table as errors, exit 2
    kept = [f for f in files if json.loads(Path(f).read_text())["cell"]["cell"] == "1.6.1:0.5.19"]
    code, out, err = _run(capsys, "--merge", "--cells", cells, *kept)
    assert code == 2, err
    assert err.strip().splitlines()[-1] == ("kvalign matrix: error: 2 of 3 planned cells have no result: "
                                             "1.6.1:0.5.21, 1.6.1:0.5.23")
    rows = {ln.split("|")[2].strip(): ln.split("|")[3].strip() for ln in out.splitlines()[2:5]}
    assert rows == {"0.5.19": "misaligned", "0.5.21 (shipped)": "error", "0.5.23": "error"}, out
    assert out.count(f"error: {matrix.NO_RESULT}") == 2
    code, out, _ = _run(capsys, "--merge", "--cells", cells, *kept, "--json")
    verdicts = [(r["sglang"], r["verdict"]) for r in json.loads(out)["rows"]]
    assert code == 2 and verdicts == [("0.5.19", "misaligned"), ("0.5.21", "error"), ("0.5.23", "error")]
    # no result at all: every planned cell named
    code, out, err = _run(capsys, "--merge", "--cells", cells)
    assert code == 2 and "3 of 3 planned cells have no result: 1.6.1:0.5.19, 1.6.1:0.5.21, 1.6.1:0.5.23" in err
    # without --cells the same two files merge quietly as a run over their pairs (why the nightly passes --cells)
    assert _run(capsys, "--merge", *kept)[0] == 1


def test_merge_refuses_a_result_the_plan_does_not_have_and_a_bad_plan(stubbed, capsys, tmp_path):
    cells = _planned(capsys, tmp_path, ["--dynamo", "1.6.1", "--sglang", "0.5.23", "--examples", "1",
                                        "--ingest-examples", "1"])
    stray = _write(tmp_path, "stray.json", _cell_doc(sglang="0.5.19", plan__ingest_examples=1))
    for argv, message in (
            (["--merge", "--cells", cells, stray], "cells.json: results for cells it does not plan: 1.6.1:0.5.19"),
            (["--merge", "--cells", _write(tmp_path, "run.json", {"rows": []}), stray],
             "run.json: not a list of planned cells (write it with kvalign matrix --list-cells --json)"),
            (["--merge", "--cells", str(tmp_path / "none.json"), stray], "cannot read planned cells file"),
            (["--cells", cells, stray], "RESULT.json files and --cells go with --merge"),
            (["--dynamo", "1.6.1", "--list-cells", "--markdown"], "--markdown prints the table of a whole run")):
        code, out, err = _run(capsys, *argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, (argv, err)


def test_markdown_is_one_run_s_rows_and_the_command_that_reproduces_them(stubbed, capsys, tmp_path):
    options = ["--dynamo", "1.6.1,1.3.1", "--sglang", "0.5.19", "--shipped", "--examples", "1"]
    code, out, _ = _run(capsys, *options, "--markdown")
    lines = out.strip().splitlines()
    assert code == 2 and lines[:2] == ["| dynamo | sglang | verdict | causes (properties) |", "|---|---|---|---|"]
    assert lines[2:5] == ["| 1.6.1 | 0.5.19 | misaligned | LORA_NOT_IN_EVENTS (ingest) |",
                          "| 1.6.1 | **0.5.21 (shipped)** | aligned | - |",
                          "| 1.3.1 | 0.5.19 | misaligned | LORA_NOT_IN_EVENTS (ingest) |"]
    assert lines[5].startswith("| 1.3.1 | **unknown (shipped)** | error | error: shipped SGLang unknown")
    command = lines[-1]
    assert command == ("`kvalign matrix --dynamo 1.6.1,1.3.1 --sglang 0.5.19 --shipped --examples 1 "
                       "--markdown`")
    # the printed command gives the same table (the command is part of it)
    assert _run(capsys, *command.strip("`").split()[2:])[:2] == (code, out)
    # merged cells print the same Markdown as the run, command included
    files = _cells_one_by_one(capsys, tmp_path, options)
    assert _run(capsys, "--merge", *files, "--markdown")[:2] == (code, out)


def test_markdown_calls_a_property_n_a_only_where_it_could_not_run():
    """A property with one variant n/a (advertised's dLLM override) is not n/a as a whole, and a release
    without SGLang's dynamo event format says so once, not as every event property."""
    na = [{"property": "advertised", "mode": "plain", "variant": "other", "reason": "dLLM override"},
          {"property": "tier", "mode": "plain", "variant": "base", "reason": "no per-tier answer"},
          {"property": "dp", "mode": "plain", "variant": "pure-dp2", "reason": "no DP oracle"},
          {"property": "dp", "mode": "plain", "variant": "dp-attn2", "reason": "no DP oracle"},
          *({"property": p, "mode": "plain", "variant": "base", "reason": "SGLang 0.5.21 has no \"dynamo\" KV-event "
             "format", "event_format": "dynamo"} for p in ("pages", "ingest"))]
    r = PairResult("1.6.1", "0.5.21", "aligned", not_applicable=na, event_formats=["default", "dynamo"])
    assert matrix._markdown_causes(r) == "n/a: advertised (other), tier, dp, dynamo event format"
    r.not_applicable = [{**na[-1], "reason": "its relay cannot decode it"}]
    assert matrix._markdown_causes(r) == "n/a: ingest [dynamo]"


def test_a_cell_outside_the_matrix_is_refused(stubbed, capsys):
    for cell in ("1.5.1:0.5.23", "1.6.1:0.5.17", "1.6.1:unknown", "1.6.1", "1.6.1:latest"):
        code, out, err = _run(capsys, *OPTIONS, "--cell", cell, "--json")
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (cell, err)


# ---- --merge refuses bad input: one line, exit 2, inputs untouched ---------------------------------

def _cell_doc(dynamo="1.6.1", sglang="0.5.23", **over) -> dict:
    row = {"dynamo": dynamo, "sglang": sglang, "shipped": False, "verdict": "aligned", "findings": []}
    doc = {"versions": {"kvalign": "0.1.0", "ai-dynamo-runtime": "1.6.1", "sglang": "0.5.23", "torch": "2.13.0+cpu"},
           "rows": [row], "format": CELL_FORMAT,
           "cell": {"cell": f"{dynamo}:{sglang}", "plan": {"dynamo": None, "sglang": None, "shipped": False,
                                                           "examples": 1, "ingest_examples": 1, "live": False}}}
    for key, value in over.items():
        target, _, name = key.rpartition("__")
        holder = {"": doc, "row": row, "cell": doc["cell"], "plan": doc["cell"]["plan"]}[target]
        holder[name] = value
    return doc


def _write(tmp: Path, name: str, doc) -> str:
    path = tmp / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


BAD = [
    ("not JSON", lambda t: [_write(t, "a.json", "{\"rows\": [")], r"a\.json: malformed cell: not JSON"),
    ("empty file", lambda t: [_write(t, "a.json", "")], r"a\.json: malformed cell: not JSON"),
    ("a whole run's report, not a cell",
     lambda t: [_write(t, "a.json", {"versions": {}, "rows": []})], r"a\.json: not a kvalign matrix cell"),
    ("a JSON list", lambda t: [_write(t, "a.json", [1, 2])], r"a\.json: not a kvalign matrix cell"),
    ("two rows", lambda t: [_write(t, "a.json", {**_cell_doc(), "rows": _cell_doc()["rows"] * 2})],
     r"a\.json: malformed cell: \"rows\" must hold exactly one row"),
    ("no cell object", lambda t: [_write(t, "a.json", {**_cell_doc(), "cell": "1.6.1:0.5.23"})],
     r"a\.json: malformed cell: no \"cell\" object"),
    ("bad verdict", lambda t: [_write(t, "a.json", _cell_doc(row__verdict="fine"))],
     r"a\.json: malformed cell: row verdict 'fine' is not one of"),
    ("finding without a cause", lambda t: [_write(t, "a.json", _cell_doc(row__findings=[{"property": "hash"}]))],
     r"a\.json: malformed cell: row 'findings' is not a list"),
    ("error row without its error", lambda t: [_write(t, "a.json", _cell_doc(row__verdict="error"))],
     r"a\.json: malformed cell: row has an 'error' string exactly when"),
    ("cell id of another row", lambda t: [_write(t, "a.json", _cell_doc(cell__cell="1.5.1:0.5.23"))],
     r"a\.json: malformed cell: cell '1\.5\.1:0\.5\.23' holds the row of '1\.6\.1:0\.5\.23'"),
    ("duplicate cell", lambda t: [_write(t, "a.json", _cell_doc()), _write(t, "b.json", _cell_doc())],
     r"b\.json: duplicate cell 1\.6\.1:0\.5\.23 \(also in .*a\.json\)"),
    ("cells of another plan", lambda t: [_write(t, "a.json", _cell_doc()),
                                         _write(t, "b.json", _cell_doc(sglang="0.5.19", plan__examples=100))],
     r"b\.json: mismatched cell: its plan .* is not .*a\.json's"),
    ("cells from another environment",
     lambda t: [_write(t, "a.json", _cell_doc()),
                _write(t, "b.json", _cell_doc(sglang="0.5.19", versions={"kvalign": "0.0.9"}))],
     r"b\.json: mismatched cell: it ran with versions"),
    ("missing file", lambda t: [_write(t, "a.json", _cell_doc()), str(t / "gone.json")],
     r"cannot read cell file .*gone\.json"),
]


@pytest.mark.parametrize("name,files,message", BAD, ids=[b[0] for b in BAD])
def test_merge_refuses_a_bad_cell_file_in_one_line(name, files, message, tmp_path, capsys):
    import re

    paths = files(tmp_path)
    before = {p: Path(p).read_bytes() for p in paths if Path(p).exists()}
    code, out, err = _run(capsys, "--merge", *paths)
    assert code == 2 and out == "", (name, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(message, err), (name, err)
    assert {p: Path(p).read_bytes() for p in before} == before


def test_a_json_row_reads_back_as_the_result_it_was_printed_from():
    rows = [PairResult("1.6.1", "0.5.21", "misaligned", [dict(FINDING)], shipped=True,
                       live={"verdict": "pass", "detail": "PASS", "seconds": 1.0}),
            PairResult("1.3.1", "unknown", "error", error="shipped SGLang unknown: x", shipped=True),
            PairResult("1.6.1", "0.5.19", "aligned", not_applicable=[
                {"property": "tier", "mode": "plain", "variant": "base", "reason": "stand-in pinned to 0.5.23"}])]
    assert [matrix.result_from_row(r.as_json()).as_json() for r in rows] == [r.as_json() for r in rows]
    assert matrix.render([matrix.result_from_row(r.as_json()) for r in rows]) == matrix.render(rows)


# ---- the nightly workflow ---------------------------------------------------------------------------

def _actionlint() -> str:
    exe = Path(sys.executable).with_name("actionlint")
    found = str(exe) if exe.exists() else shutil.which("actionlint")
    assert found, "actionlint is not installed: scripts/setup.sh installs it with the test extras (.[test])"
    return found


def test_the_nightly_workflow_passes_actionlint(tmp_path):
    res = subprocess.run([_actionlint(), "-no-color", str(WORKFLOW)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    # the check bites: a job that needs a job the workflow does not have is an error
    broken = tmp_path / ".github" / "workflows" / "broken.yml"
    broken.parent.mkdir(parents=True)
    broken.write_text(WORKFLOW.read_text().replace("needs: list-cells", "needs: list-cell"))
    res = subprocess.run([_actionlint(), "-no-color", str(broken)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 1 and "list-cell" in res.stdout, res.stdout + res.stderr


def test_the_workflow_fans_out_the_cells_and_merges_them():
    text = WORKFLOW.read_text()
    for piece in ("kvalign matrix $MATRIX_OPTIONS --list-cells --json", "fromJSON(needs.list-cells.outputs.cells)",
                  '--cell "$CELL" --json > cell.json', "actions/upload-artifact", "actions/download-artifact",
                  'kvalign matrix --merge --cells planned/cells.json "${results[@]}"', "HYPOTHESIS_PROFILE: nightly",
                  ".venv/bin/python -m pytest -p pytest_split.plugin --splits 4 --group \"$GROUP\"",
                  "--durations-path tests/durations.json"):
        assert piece in text, piece
    assert text.count("run: ./scripts/setup.sh") == 4  # every CPU job sets up as a user does


def test_the_workflow_uploads_every_cell_result_and_runs_the_gpu_tests_on_a_named_runner():
    import re

    jobs = re.split(r"\n  (?=[a-z-]+:\n)", WORKFLOW.read_text())  # one piece per job (actionlint checks the YAML)
    cell = next(j for j in jobs if j.startswith("cell:"))
    upload = cell[cell.index("actions/upload-artifact"):]
    assert "if: ${{ always() }}" in upload.split("- ")[0] and "path: cell.json" in upload
    merge = next(j for j in jobs if j.startswith("merge:"))
    assert "--cells planned/cells.json" in merge and merge.count("--cells planned/cells.json") == 3
    gpu = next(j for j in jobs if j.startswith("gpu:"))
    assert "runs-on: ${{ fromJSON(github.event.inputs.gpu_runner_labels || vars.KVALIGN_GPU_RUNNER_LABELS) }}" in gpu
    assert 'pytest -m "gpu_1 or gpu_2"' in gpu and 'KVALIGN_REQUIRE_GPU: "1"' in gpu
    assert "scripts/gpu/requirements-gpu.txt" in gpu and "torch==2.11.0" in gpu  # the set that ran on the H100


@pytest.mark.slow
def test_the_nightly_groups_partition_the_suite():
    """The four pytest-split groups of the nightly, on the recorded durations, hold every collected
    test exactly once (a test in no group would never run at night)."""
    def collect(*args: str) -> list[str]:
        res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *args],
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        return [line for line in res.stdout.splitlines() if "::" in line]

    from types import SimpleNamespace

    from pytest_split.algorithms import Algorithms

    whole = collect()
    # pytest-split's own algorithm (the one its plugin runs for --splits) on the collected ids: one
    # collection instead of five, the same partition
    durations = json.loads((ROOT / "tests" / "durations.json").read_text())
    algorithm = Algorithms.duration_based_chunks.value
    groups = [[i.nodeid for i in g.selected]
              for g in algorithm(4, [SimpleNamespace(nodeid=n) for n in whole], durations)]
    assert all(groups) and sorted(sum(groups, [])) == sorted(whole)


# ---- the real pair, run here: one run = the merge of its cells ------------------------------------

@pytest.mark.slow
def test_cells_of_the_installed_pair_merge_into_the_single_run_table(tmp_path, installed_cell):
    """The cell is the session's ``installed_cell`` (tests/unit/installed_cell.py: card and hash, a child per run
    and per cell as in a full run, without minutes of state machines), which test_local_build.py holds a pull
    request's build to; the run beside it has the same options."""
    from installed_cell import matrix as kvalign_matrix
    from installed_cell import options

    from kvalign.releases.versions import installed_versions

    v = installed_versions()
    opts = options(v["ai-dynamo-runtime"], v["sglang"])
    single = kvalign_matrix(*opts, cwd=tmp_path)
    assert single.returncode in (0, 1), single.stderr[-2000:]
    listed = kvalign_matrix(*opts, "--list-cells", "--json", cwd=tmp_path)
    cells = json.loads(listed.stdout)
    assert [c["cell"] for c in cells] == [f"{v['ai-dynamo-runtime']}:{v['sglang']}"] == [installed_cell.cell]
    # the one cell listed, as its CI job runs it: `matrix OPTIONS --cell CELL --json`
    assert installed_cell.returncode == single.returncode, installed_cell.stderr[-2000:]
    cell_file = tmp_path / f"{installed_cell.cell.replace(':', '_')}.json"
    cell_file.write_text(installed_cell.stdout)
    merged = kvalign_matrix("--merge", str(cell_file), cwd=tmp_path)
    assert (merged.returncode, merged.stdout) == (single.returncode, single.stdout)
    merged_json = json.loads(kvalign_matrix("--merge", str(cell_file), "--json", cwd=tmp_path).stdout)
    assert merged_json["versions"] == installed_versions()
    assert [matrix.result_from_row(r).as_json() for r in merged_json["rows"]] == merged_json["rows"]
