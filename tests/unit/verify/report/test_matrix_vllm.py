"""``kvalign matrix --engine vllm``: the shipped vLLM pin, the per-release probe, the table, and bad input.

The fast tier reads Dynamo 1.6.1's real wheel METADATA and drives the command's error paths; the
install-and-run of the official vLLM wheels is ``matrix``-marked (as the SGLang release matrix is):
it downloads two ~336 MB CUDA wheels into the wheel cache once, then checks each pair's rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvalign.releases.release_env import ReleaseEnvError
from kvalign.releases.vllm_env import RELEASE_ENV
from kvalign.verify.report import matrix_vllm
from kvalign.verify.report.matrix import MatrixError, Pair, PairResult, exit_code, render, render_markdown

ROOT = Path(__file__).resolve().parents[4]
META = ("Requires-Dist: sglang[diffusion]==0.5.21; extra == 'sglang'\n"
        "Requires-Dist: vllm[flashinfer,otel,runai]==0.31.0; extra == 'vllm'\n"
        "Requires-Dist: vllm-omni==0.9; extra == 'vllm'\nRequires-Dist: pyzmq\n")


def _kvalign(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "kvalign", *argv], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_the_shipped_vllm_is_the_exact_pin_of_the_vllm_extra():
    assert matrix_vllm.shipped_vllm_from_metadata(META) == "0.31.0"
    assert matrix_vllm.shipped_vllm_from_metadata(META.replace("==0.31.0", ">=0.31")) is None  # no exact pin
    assert matrix_vllm.shipped_vllm_from_metadata("Requires-Dist: vllm==0.31.0\n") is None  # not under the extra


def test_dynamo_1_6_1_ships_vllm_0_31_0_read_from_its_wheel():
    assert matrix_vllm.shipped_vllm("1.6.1") == "0.31.0"


def _ran(stdout: str = "", returncode: int = 0, stderr: str = ""):
    return lambda cmd, **kw: subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def test_a_release_that_does_not_install_import_or_match_is_an_error_naming_it(monkeypatch):
    def no_wheel(dist, version):
        raise ReleaseEnvError(f"cannot install {dist}=={version}: No solution found")

    monkeypatch.setattr(matrix_vllm, "ensure", no_wheel)
    with pytest.raises(MatrixError, match=r"^vllm 9\.9\.9 cannot be installed: .*vllm==9\.9\.9"):
        matrix_vllm.probe("9.9.9")
    monkeypatch.setattr(matrix_vllm, "ensure", lambda dist, version: sys.executable)
    broken = _ran(returncode=1, stderr="Traceback\nTypeError: KVCacheManager.__init__() got an unexpected keyword\n")
    with pytest.raises(MatrixError, match=r"^vllm 0\.16\.0: kvalign's vLLM oracle cannot run it on CPU: TypeError: KVCache"):
        matrix_vllm.probe("0.16.0", run=broken)
    with pytest.raises(MatrixError, match=r"its environment runs vllm 0\.32\.0"):
        matrix_vllm.probe("0.33.0", run=_ran("0.32.0\n"))
    assert matrix_vllm.probe("0.33.0", run=_ran("0.33.0\n")) == sys.executable  # the control


def test_a_broken_release_is_an_error_row_of_each_of_its_pairs_and_exit_2(monkeypatch):
    def probe(version):
        raise MatrixError(f"vllm {version} cannot be installed: nope")

    monkeypatch.setattr(matrix_vllm, "probe", probe)
    results = matrix_vllm.run_matrix([Pair("1.6.1", "0.0.1")], examples=1)
    assert [(r.verdict, r.error) for r in results] == [("error", "vllm 0.0.1 cannot be installed: nope")]
    assert exit_code(results) == 2
    assert "1.6.1 x 0.0.1: error: vllm 0.0.1 cannot be installed: nope" in render(results, engine="vllm",
                                                                                    columns=[], scope="s")


def test_the_pair_runs_check_engine_vllm_in_dynamo_s_environment_on_its_vllm():
    python, env = matrix_vllm.pair_env(None, "0.33.0")
    assert python == sys.executable and env[RELEASE_ENV] == "vllm==0.33.0"
    assert matrix_vllm.check_command(python, 7)[1:] == ["-m", "kvalign", "check", "--engine", "vllm", "--json",
                                                        "--vllm-examples", "7"]
    assert "--vllm-examples" not in matrix_vllm.check_command(python, None)
    assert "--all" in matrix_vllm.check_command(python, 7, True) and "--all" not in matrix_vllm.check_command(python, 7)


def _results() -> list[PairResult]:
    rows = [("hash", "plain"), ("pages", "plain"), ("tenants", "plain")]
    finding = {"property": "tenants", "mode": "plain", "variant": "namespace", "cause": "TENANTS_SHARE_KEYS",
               "detail": "x", "class": "cache-blind"}
    return [PairResult("1.6.1", "0.31.0", "aligned", shipped=True, rows=rows),
            PairResult("1.5.1", "0.28.0", "misaligned", [finding], shipped=True, rows=rows),
            PairResult("1.0.2", "0.16.0", "error", error="vllm 0.16.0: no", shipped=True)]


def test_the_table_has_the_sglang_matrix_s_shape_with_a_vllm_column_per_row_check_printed():
    results = _results()
    cols = matrix_vllm.columns(results)
    assert cols == [("hash", "plain"), ("pages", "plain"), ("tenants", "plain")]
    scope = matrix_vllm.scope_line(False)
    lines = render(results, engine="vllm", columns=cols, scope=scope).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "dynamo", "vllm", "verdict", "hash:plain", "pages:plain", "tenants:plain"]
    assert [c.strip() for c in lines[3].strip("|").split("|")][1:] == [
        "0.28.0 (shipped)", "misaligned", "ok", "ok", "TENANTS_SHARE_KEYS"]
    assert scope in lines and scope == ("Verdicts for deployments without vLLM workers with "
                                        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; not run: vllm_bytes (--all runs every "
                                        "property).")
    assert matrix_vllm.scope_line(True) is None  # --all: every vLLM property ran, as the SGLang matrix says nothing
    md = render_markdown(results, "kvalign matrix --engine vllm --markdown", engine="vllm", scope=scope).splitlines()
    assert md[0] == "| dynamo | vllm | verdict | causes (properties) |"
    assert md[3] == "| 1.5.1 | **0.28.0 (shipped)** | misaligned | TENANTS_SHARE_KEYS (tenants) |"
    assert md[-3:] == [scope, "", "`kvalign matrix --engine vllm --markdown`"]
    assert exit_code(results) == 2 and exit_code(results[:2]) == 1 and exit_code(results[:1]) == 0


def test_a_row_only_a_finding_names_still_gets_its_column():
    r = PairResult("1.6.1", "0.33.0", "misaligned", [{"property": "mm", "mode": "plain", "variant": "base",
                                                      "cause": "X", "detail": ""}], rows=[("hash", "plain")])
    assert matrix_vllm.columns([r]) == [("hash", "plain"), ("mm", "plain")]


def test_the_json_names_each_row_s_vllm_release():
    doc = matrix_vllm.report_json(_results(), {"kvalign": "x"}, [("hash", "plain")])
    assert doc["engine"] == "vllm" and doc["properties"] == ["hash"]
    assert doc["scope"]["ran"] == ["vllm"] and doc["scope"]["not_run"] == [
        {"property": "vllm_bytes", "surface": "vLLM workers with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0"}]
    assert matrix_vllm.report_json([], {}, [], all_props=True)["scope"]["not_run"] == []
    assert [(r["dynamo"], r["vllm"], r["shipped"]) for r in doc["rows"]][0] == ("1.6.1", "0.31.0", True)
    assert all("sglang" not in r for r in doc["rows"])


@pytest.mark.matrix
@pytest.mark.nightly
@pytest.mark.timeout(1800)
def test_the_shipped_pair_and_the_newest_vllm_run_their_rows_on_the_official_wheels(official_vllm_wheels):
    """Dynamo 1.6.1 x vllm 0.31.0 (its pin) and x 0.33.0, each official wheel installed once into the wheel
    cache and imported on CPU: every row of check --engine vllm ran on each, none n/a."""
    res = _kvalign("matrix", "--engine", "vllm", "--dynamo", "1.6.1", "--vllm", "0.33.0", "--shipped",
                   "--examples", "5", "--json", timeout=1700)
    assert res.returncode in (0, 1), res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert [(r["dynamo"], r["vllm"], r["shipped"]) for r in doc["rows"]] == [("1.6.1", "0.31.0", True),
                                                                          ("1.6.1", "0.33.0", False)]
    assert {"hash", "pages", "ingest", "tenants"} <= set(doc["properties"])
    assert all(r["verdict"] != "error" and "not_applicable" not in r for r in doc["rows"]), doc["rows"]


def test_a_check_that_crashed_is_an_error_row_naming_its_exception_not_the_search_s_last_line():
    from kvalign.verify.report.matrix import check_result

    stderr = ("Traceback (most recent call last):\n  File \"x.py\", line 1\nkvalign.oracles.vllm.VllmError: TypeError: "
              "list indices must be integers\nFailing test case: search(\n    value=[1],\n)\n")
    r = check_result("1.3.1", "0.23.0", subprocess.CompletedProcess([], 1, "", stderr), 1.0)
    assert r.verdict == "error" and r.error.endswith("VllmError: TypeError: list indices must be integers")
    plain = check_result("1.3.1", "0.23.0", subprocess.CompletedProcess([], 1, "", "a\nlast words\n"), 1.0)
    assert plain.error == "check exited 1 without a JSON report: last words"  # no exception: the last line


def test_a_vllm_release_the_oracle_does_not_drive_is_n_a_with_its_reason_never_an_error(monkeypatch):
    """Dynamo 1.0.2 x vLLM 0.16.0 (its pin): nothing installed or probed, every column n/a with the reason, exit 0."""
    monkeypatch.setattr(matrix_vllm, "probe", lambda v: pytest.fail(f"probed {v}"))
    [na] = matrix_vllm.run_matrix([Pair("1.0.2", "0.16.0", shipped=True)], examples=1)
    ran = PairResult("1.6.1", "0.31.0", "aligned", rows=[("hash", "plain"), ("events", "map")])
    cols = matrix_vllm.columns([ran])
    matrix_vllm.fill_not_applicable([na, ran], cols)
    assert na.verdict == "n/a" and exit_code([na, ran]) == 0
    assert [(n["property"], n["mode"]) for n in na.not_applicable] == cols
    assert all(n["reason"] == matrix_vllm.NOT_DRIVEN["0.16.0"] for n in na.not_applicable)
    plain = render([ran, na], engine="vllm", columns=cols, scope="s")
    assert "| 1.0.2  | 0.16.0 (shipped) | n/a " in plain and "ok" not in plain.splitlines()[3]
    assert f"1.0.2 x 0.16.0: n/a hash:plain, events:map: {matrix_vllm.NOT_DRIVEN['0.16.0']}" in plain
    md = render_markdown([na], "kvalign matrix --engine vllm --markdown", engine="vllm", scope="s")
    assert "| 1.0.2 | **0.16.0 (shipped)** | n/a | n/a: hash, events |" in md
