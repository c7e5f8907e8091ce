"""``kvalign matrix``: release install cache, per-pair subprocess, table and JSON, for real.

``test_older_dynamo_release_against_the_installed_sglang`` installs one real older Dynamo release
(1.0.2: its binding lacks ``is_eagle`` and ``cache_namespace``, its relay cannot decode bigram events
and ignores ``cache_salt``, its ``dynamo.sglang`` does not import with SGLang 0.5.23) into the wheel
cache and checks it against the installed SGLang on every run, so the adapters and the new causes
are exercised on a real wheel, not mocked. The full default matrix is ``matrix`` + ``nightly`` and
runs only when asked for (``-m matrix`` / ``-m nightly`` or ``KVALIGN_NIGHTLY=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kvalign.verify.props import REGISTRY
from kvalign.verify.report import matrix
from kvalign.cli import main
from kvalign.verify.report.matrix import (MatrixError, Pair, PairEnv, PairResult, cache_root,
                            default_dynamo_versions, ensure_release, pair_env, plan_pairs, render, requires_dist,
                            result_from_row, sglang_roots, shipped_sglang, shipped_sglang_from_metadata, table,
                            unsatisfied)
from kvalign.releases.versions import installed_versions

OLD_DYNAMO = "1.0.2"
ROOT = Path(__file__).resolve().parents[4]


def _kvalign(*argv: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "kvalign", *argv], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_table_has_a_row_per_pair_and_a_cell_per_property_and_mode():
    rows = [
        PairResult("1.6.1", "0.5.23", "aligned"),
        PairResult("1.0.2", "0.5.23", "misaligned", [
            {"property": "ingest", "mode": "eagle", "variant": "base", "cause": "EVENTS_DROPPED", "detail": "x"},
            {"property": "ingest", "mode": "eagle", "variant": "lora", "cause": "EVENTS_DROPPED", "detail": "y"},
            {"property": "hash", "mode": "plain", "variant": "namespace", "cause": "NAMESPACE_DROPPED", "detail": "z"},
        ]),
        PairResult("1.3.1", "0.5.17", "error", error="cannot install sglang==0.5.17"),
    ]
    lines = table(rows).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:3] == ["dynamo", "sglang", "verdict"] and "ingest:eagle" in head and "card:plain" in head
    assert len(head) == 3 + sum(len(p.modes) for p in REGISTRY if p.default and p.engine == "sglang") and len(lines) == 2 + 3
    assert "advertised:plain" in head and "advertised:eagle" not in head  # a page size does not depend on EAGLE
    assert "dp:plain" in head and "dp:eagle" not in head  # no DP rank decision reads the key mode
    cells = {h: c.strip() for h, c in zip(head, lines[3].strip("|").split("|"))}
    assert cells["ingest:eagle"] == "EVENTS_DROPPED" and cells["hash:plain"] == "NAMESPACE_DROPPED"
    assert cells["card:plain"] == "ok" and cells["verdict"] == "misaligned"
    assert set(c.strip() for c in lines[4].strip("|").split("|")[3:]) == {"error"}


def _dist(target: Path, name: str, version: str, *requires: str) -> None:
    info = target / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires) + "\nlong description\n")


def test_sglang_roots_are_its_coupled_pins_and_what_the_environment_has(tmp_path):
    meta = ("Name: sglang\nRequires-Dist: transformers==5.12.1\nRequires-Dist: flashinfer_python==0.6.17\n"
            "Requires-Dist: numpy\nRequires-Dist: torch==2.14.1\nRequires-Dist: openai==2.6.1; extra == 'x'\n")
    env = {"numpy": "2.3.5", "torch": "2.13.0+cpu", "transformers": "5.19.0"}.get
    assert [str(r) for r in sglang_roots(meta, env)] == ["transformers==5.12.1", "numpy"]


def test_the_install_closes_over_what_the_pinned_packages_require(tmp_path):
    """SGLang 0.5.18 pins transformers 5.12.1, which wants tokenizers <= 0.23.0: the environment's
    0.23.2 does not do, so tokenizers is asked for too (the 1.5.1 x 0.5.18 error this fixes)."""
    _dist(tmp_path, "sglang", "0.5.18", "transformers==5.12.1", "flashinfer_python==0.6.17")
    _dist(tmp_path, "transformers", "5.12.1", "tokenizers<=0.23.0,>=0.22.0", "huggingface-hub>=1.0",
          "torch>=2.4; extra == 'torch'")
    env = {"tokenizers": "0.23.2", "huggingface-hub": "1.2.0", "transformers": "5.19.0"}.get
    roots = [Requirement("transformers==5.12.1")]
    assert [str(r) for r in unsatisfied(tmp_path, roots, env)] == ["tokenizers<=0.23.0,>=0.22.0"]
    _dist(tmp_path, "tokenizers", "0.23.0")
    assert unsatisfied(tmp_path, roots, env) == []


def test_an_extra_s_own_requirements_are_told_apart_from_the_base_set():
    meta = ("Requires-Dist: uvloop; extra == 'sglang'\nRequires-Dist: sglang[diffusion]==0.5.21; extra == 'sglang'\n"
            "Requires-Dist: tomli; (python_version < '3.0') and extra == 'sglang'\nRequires-Dist: pyzmq\n"
            "Requires-Dist: vllm==0.9; extra == 'vllm'\n")
    assert [r.name for r in requires_dist(meta, extra="sglang")] == ["uvloop", "sglang"]
    assert [r.name for r in requires_dist(meta)] == ["pyzmq"]
    assert shipped_sglang_from_metadata(meta) == "0.5.21"
    assert shipped_sglang_from_metadata("Requires-Dist: sglang>=0.5; extra == 'sglang'\n") is None


@pytest.mark.timeout(300)
def test_each_dynamo_release_s_shipped_sglang_is_read_from_its_real_wheel():
    """The pins as published: ai-dynamo 1.6.1 (the environment's) -> sglang 0.5.21; 1.5.1 (installed
    into the wheel cache from the package index) -> 0.5.18."""
    from kvalign.verify.report.matrix import installed

    if installed("ai-dynamo") != "1.6.1":
        pytest.skip(f"the environment's ai-dynamo is {installed('ai-dynamo')}, not the pinned 1.6.1")
    assert shipped_sglang("1.6.1") == "0.5.21"
    try:
        assert shipped_sglang("1.5.1") == "0.5.18"
    except MatrixError as exc:
        pytest.skip(f"ai-dynamo 1.5.1 cannot be installed here: {exc}")


def test_shipped_pairs_join_the_cross_product_marked():
    pins = {"1.5.1": "0.5.18", "1.6.1": "0.5.21"}

    def pinned(d: str) -> str | None:
        if d == "0.0.1":
            raise MatrixError("cannot install ai-dynamo-runtime==0.0.1: no such release\n(pip said more)")
        return pins.get(d)

    pairs, unknown = plan_pairs(["1.5.1", "1.6.1", "0.0.1"], ["0.5.21", "0.5.23"], shipped=True, pinned=pinned)
    assert pairs == [Pair("1.5.1", "0.5.18", True), Pair("1.5.1", "0.5.21"), Pair("1.5.1", "0.5.23"),
                     Pair("1.6.1", "0.5.21", True), Pair("1.6.1", "0.5.23"),
                     Pair("0.0.1", "0.5.21"), Pair("0.0.1", "0.5.23")]
    assert unknown == {"0.0.1": "(pip said more)"}
    assert plan_pairs(["1.6.1"], ["0.5.23"], shipped=False, pinned=pinned) == ([Pair("1.6.1", "0.5.23")], {})
    # without --shipped nothing is added and an unreadable pin is no error row, but a shipped pair is marked
    assert plan_pairs(["1.6.1", "0.0.1"], ["0.5.21"], shipped=False, pinned=pinned) == (
        [Pair("1.6.1", "0.5.21", True), Pair("0.0.1", "0.5.21")], {})
    assert plan_pairs(["1.6.1"], [], shipped=True, pinned=pinned)[0] == [Pair("1.6.1", "0.5.21", True)]


def test_an_error_row_carries_its_reason_in_one_line():
    row = PairResult("1.5.1", "0.5.18", "error", error="Traceback...\n  ...\nImportError: tokenizers>=0.22.0,<=0.23.0 is required")
    assert row.as_json()["error"] == "ImportError: tokenizers>=0.22.0,<=0.23.0 is required"
    assert "error" not in PairResult("1.6.1", "0.5.23", "aligned").as_json()


def test_pair_env_runs_the_releases_in_an_environment_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setenv("KVALIGN_WHEEL_CACHE", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    python, env = pair_env(tmp_path / "ai-dynamo-1.0.2", None, "0.5.23")
    assert python != sys.executable and Path(python).is_relative_to(tmp_path / "envs")
    assert "PYTHONPATH" not in env  # an inherited entry would precede the release
    assert env["TORCH_EXTENSIONS_DIR"].startswith(str(tmp_path)) and cache_root() == tmp_path
    # the installed pair runs in the running interpreter, its environment as is
    python, env = pair_env(None, None, "0.5.23")
    assert python == sys.executable and env["PYTHONPATH"] == "/elsewhere"


def test_default_dynamo_releases_are_read_from_the_index_and_filtered():
    out = "ai-dynamo-runtime (1.6.1)\nAvailable versions: 1.7.0, 1.6.1, 1.3.0.post1, 1.0.0, 0.9.1\n"
    fake = lambda *a, **k: subprocess.CompletedProcess(a, 0, out, "")  # noqa: E731
    assert default_dynamo_versions(fake) == ["1.0.0", "1.3.0.post1", "1.6.1"]


@pytest.mark.parametrize(("argv", "message"), [
    (["matrix", "--dynamo", "1.6.1;rm", "--sglang", "0.5.23"], "--dynamo takes comma-separated release versions"),
    (["matrix", "--dynamo", "1.6.1", "--sglang", ","], "--sglang takes comma-separated release versions"),
    (["matrix", "--dynamo", "1.6.1", "--jobs", "0"], "--jobs must be >= 1"),
])
def test_matrix_usage_errors_are_one_line_exit_2(capsys, argv, message):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and message in err


HANGING_CHECK = """
import time
from kvalign.runtime_log import RuntimeLog
with RuntimeLog("check"):
    time.sleep(120)
"""


def test_a_hung_pair_check_is_stopped_and_names_the_log_that_holds_its_stacks(tmp_path, monkeypatch):
    monkeypatch.setattr(matrix, "PAIR_TIMEOUT_S", 3)
    monkeypatch.setenv("KVALIGN_LOG_DIR", str(tmp_path))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with pytest.raises(MatrixError, match="check did not finish within 3s; its threads' stacks") as info:
        matrix._run_check([sys.executable, "-c", HANGING_CHECK], env)
    log = Path(str(info.value).rsplit(": ", 1)[1])
    text = log.read_text()
    assert log.parent == tmp_path and "Fatal Python error: Aborted" in text and 'File "<string>", line 5' in text, text


#: A check whose process deadlocks the way 1.0.2's KvRouter constructor did (the GIL held forever):
#: the router path's faulthandler watchdog writes the stacks to the runtime log and exits 1.
DEADLOCKED_CHECK = """
import faulthandler, time
from kvalign.runtime_log import RuntimeLog
with RuntimeLog("check"):
    faulthandler.dump_traceback_later(0.2, exit=True)
    time.sleep(120)
"""


def test_a_deadlocked_pair_check_is_named_from_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("KVALIGN_LOG_DIR", str(tmp_path))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with pytest.raises(matrix.RuntimeDeadlock, match="in-process Dynamo runtime deadlocked .* stacks: ") as info:
        matrix._run_check([sys.executable, "-c", DEADLOCKED_CHECK], env)
    assert Path(str(info.value).rsplit(": ", 1)[1]).parent == tmp_path
    # the negative control: a check that exits 1 with its report is a misaligned pair, not a deadlock
    done = matrix._run_check([sys.executable, "-c", "import sys; print('{}'); sys.exit(1)"], env)
    assert done.returncode == 1


def test_a_deadlocked_pair_check_runs_once_more(monkeypatch):
    """The deadlock is intermittent (2 of about 7 checks of 1.0.2 x 0.5.23), so the pair gets a second run;
    a second deadlock is the row's error."""
    report = {"aligned": True, "rows": []}
    runs: list[int] = []

    def flaky(cmd, env):
        runs.append(1)
        if len(runs) == 1:
            raise matrix.RuntimeDeadlock("the check's in-process Dynamo runtime deadlocked")
        return subprocess.CompletedProcess(cmd, 0, json.dumps(report) + "\n", "")

    monkeypatch.setattr(matrix, "ensure_release", lambda kind, version, log=None: None)
    monkeypatch.setattr(matrix, "_run_check", flaky)
    lines: list[str] = []
    row = matrix.run_pair("1.0.2", "0.5.23", examples=1, ingest_examples=1, log=lines.append)
    assert row.verdict == "aligned" and len(runs) == 2 and "running its check once more" in lines[-1]

    def stuck(cmd, env):
        raise matrix.RuntimeDeadlock("the check's in-process Dynamo runtime deadlocked")

    monkeypatch.setattr(matrix, "_run_check", stuck)
    row = matrix.run_pair("1.0.2", "0.5.23", examples=1, ingest_examples=1)
    assert row.verdict == "error" and "deadlocked" in row.error


@pytest.mark.slow  # a pip run against the index
def test_uninstallable_release_is_an_error_row_exit_2(tmp_path):
    env_cache = tmp_path / "wheels"
    res = subprocess.run([sys.executable, "-m", "kvalign", "matrix", "--dynamo", "0.0.999", "--sglang", "0.5.23", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, KVALIGN_WHEEL_CACHE=str(env_cache),
                                  PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
    assert res.returncode == 2, res.stderr
    report = json.loads(res.stdout)
    assert report["versions"] == installed_versions()
    (row,) = report["rows"]
    assert row["verdict"] == "error" and row["findings"] == [] and (row["dynamo"], row["sglang"]) == ("0.0.999", "0.5.23")
    assert row["error"].startswith("cannot install ai-dynamo-runtime==0.0.999") and "\n" not in row["error"]
    assert "cannot install ai-dynamo-runtime==0.0.999" in res.stderr
    assert not (env_cache / "ai-dynamo-0.0.999" / ".complete").exists()


@pytest.mark.slow  # installs (or reuses) a real Dynamo release and runs check on it: about 1 minute
@pytest.mark.nightly
@pytest.mark.skipif(os.environ.get("KVALIGN_NIGHTLY") != "1", reason="1.0.2 x the installed SGLang: nightly only "
                    "(KVALIGN_NIGHTLY=1), beside the README's table, which holds the same pair; CI runs 1.0.2 and 1.3.1 "
                    "with their shipped SGLang below")
@pytest.mark.timeout(900)
def test_older_dynamo_release_against_the_installed_sglang(sglang_available):
    """(1.0.2's runtime can deadlock inside a check; the matrix runs such a pair once more.)"""
    argv = ("matrix", "--dynamo", OLD_DYNAMO, "--sglang", sglang_available, "--json", "--examples", "40",
            "--ingest-examples", "12", "--event-format", "default")
    res = _kvalign(*argv)
    (row,) = json.loads(res.stdout)["rows"]
    if row["verdict"] == "error" and "cannot install" in res.stderr:
        pytest.skip(f"ai-dynamo {OLD_DYNAMO} cannot be installed here: {res.stderr.strip().splitlines()[-1]}")
    assert res.returncode == 1, res.stderr
    assert set(row) <= {"dynamo", "sglang", "shipped", "verdict", "findings", "not_applicable", "event_formats"}
    assert row["verdict"] == "misaligned" and row["event_formats"] == ["default"]
    # the tier rows: run where the release's router answers per tier, else n/a with the reason; 1.0.2's
    # dynamo.sglang has no registration function kvalign reads the block size through (advertised: n/a), and its
    # dynamo.sglang does not import beside this SGLang, so the DP oracle cannot place its ranks (dp: n/a)
    assert all(n["property"] in ("tier", "servable", "advertised", "dp") and n["reason"] for n in row.get("not_applicable", []))
    assert all("DP oracle cannot place" in n["reason"] for n in row["not_applicable"] if n["property"] == "dp")
    assert all(set(f) == {"property", "mode", "variant", "cause", "detail"} for f in row["findings"])
    found = {(f["property"], f["mode"], f["cause"]) for f in row["findings"]}
    # the 1.0.x binding has no is_eagle / cache_namespace (adapter -> named causes, not a crash)
    assert ("hash", "eagle", "ROUTER_EAGLE_OFF") in found and ("hash", "plain", "NAMESPACE_DROPPED") in found
    # its relay cannot decode bigram events (#5096) and keys salted events without the salt
    assert ("ingest", "eagle", "EVENTS_DROPPED") in found and ("ingest", "plain", "TENANTS_SHARE_KEYS") in found
    # plain, untenanted traffic is aligned on every piece of the path
    assert not [f for f in row["findings"] if f["mode"] == "plain" and f["variant"] == "base" and f["property"] != "card"]
    assert (cache_root() / f"ai-dynamo-{OLD_DYNAMO}" / ".complete").exists()


def _nightly(request: pytest.FixtureRequest) -> None:
    expr = request.config.getoption("markexpr") or ""
    if not (os.environ.get("KVALIGN_NIGHTLY") or "matrix" in expr or "nightly" in expr):
        pytest.skip("full release matrix: nightly only (select with -m matrix or KVALIGN_NIGHTLY=1)")


@pytest.mark.matrix
@pytest.mark.nightly
@pytest.mark.timeout(7200)
def test_default_release_matrix(request):
    _nightly(request)
    res = _kvalign("matrix", "--json", "--jobs", "2", timeout=7000)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    rows = json.loads(res.stdout)["rows"]
    # every pair is checked, the shipped ones older than the unified cache (1.3.1's 0.5.14, 1.0.x's
    # 0.5.9) on the RadixCache their servers build; what a release cannot run is n/a with its reason
    assert len(rows) >= 4 * 13 and not [r for r in rows if r["verdict"] == "error"]
    assert all(n["reason"] for r in rows for n in r.get("not_applicable", []))
    pinned = next(r for r in rows if (r["dynamo"], r["sglang"]) == ("1.6.1", "0.5.23"))
    assert pinned["verdict"] == "aligned", pinned


def test_the_dynamo_event_format_has_a_column_of_its_own():
    """A check run with --event-format both: its dynamo rows fill format:dynamo (never a property column);
    a release without the format is n/a there; a run without it shows no such column."""
    dyn = {"property": "tenants", "mode": "plain", "variant": "lora", "cause": "LORA_NOT_IN_EVENTS", "detail": "x",
           "event_format": "dynamo"}
    na = {"property": "pages", "mode": "plain", "variant": "base", "event_format": "dynamo",
          "reason": "SGLang 0.5.21 has no \"dynamo\" KV-event format (...)"}
    rows = [PairResult("1.6.1", "0.5.23", "misaligned", [dyn], event_formats=["default", "dynamo"]),
            PairResult("1.6.1", "0.5.21", "aligned", [], not_applicable=[na], event_formats=["default", "dynamo"]),
            PairResult("1.6.1", "0.5.19", "aligned", [], event_formats=["default"])]
    lines = table(rows).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [{h: c.strip() for h, c in zip(head, line.strip("|").split("|"))} for line in lines[2:]]
    assert [c["format:dynamo"] for c in cells] == ["LORA_NOT_IN_EVENTS", "n/a", "-"]
    assert cells[0]["tenants:plain"] == "ok" and cells[1]["pages:plain"] == "ok"
    assert "format:dynamo" not in table(rows[2:]).splitlines()[0]
    row = rows[0].as_json()
    assert row["event_formats"] == ["default", "dynamo"] and row["findings"][0]["event_format"] == "dynamo"
    assert result_from_row(row) == rows[0]


def test_a_row_a_release_cannot_run_is_n_a_with_its_reason_never_ok():
    why = "kvalign's HiCache transfer stand-in is pinned to SGLang 0.5.23; SGLang 0.5.14's host-tier internals are unchecked"
    na = [{"property": "tier", "mode": m, "variant": "base", "reason": why} for m in ("plain", "eagle")]
    row = PairResult("1.3.1", "0.5.14", "misaligned", [
        {"property": "tier", "mode": "plain", "variant": "lora", "cause": "EVENTS_DROPPED", "detail": "x"}],
        shipped=True, not_applicable=na)
    lines = table([row]).splitlines()
    cells = dict(zip([c.strip() for c in lines[0].strip("|").split("|")], [c.strip() for c in lines[2].strip("|").split("|")]))
    assert cells["tier:eagle"] == "n/a" and cells["tier:plain"] == "EVENTS_DROPPED, n/a" and cells["card:plain"] == "ok"
    assert f"1.3.1 x 0.5.14: n/a tier:plain, tier:eagle: {why}" in render([row])
    assert row.as_json()["not_applicable"] == na and result_from_row(row.as_json()).not_applicable == na
    assert "not_applicable" not in PairResult("1.6.1", "0.5.23", "aligned").as_json()
    for bad in ([], [{"property": "tier", "mode": "plain", "variant": "base"}]):  # empty, or without its reason
        with pytest.raises(ValueError, match="not_applicable"):
            result_from_row({**row.as_json(), "not_applicable": bad})


def _shipped_pair_env(dynamo: str) -> tuple[str, PairEnv]:
    """The shipped SGLang of ``dynamo`` and the environment ``matrix`` checks that pair in (installed into
    the wheel cache as ``matrix`` installs it); skips where the package index cannot be reached."""
    try:
        sglang = shipped_sglang(dynamo)
        assert sglang is not None
        return sglang, pair_env(ensure_release("dynamo", dynamo), ensure_release("sglang", sglang), sglang)
    except MatrixError as exc:
        pytest.skip(f"ai-dynamo {dynamo} or its shipped SGLang cannot be installed here: {exc}")


def _check_in(pair: PairEnv, *argv: str) -> dict:
    res = subprocess.run([pair.python, "-m", "kvalign", "check", "--json", *argv], capture_output=True, text=True,
                         env=pair.env, timeout=900, cwd=ROOT)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    return json.loads(res.stdout.splitlines()[-1])


@pytest.mark.slow  # installs (or reuses) ai-dynamo 1.3.1 and sglang 0.5.14, then checks them in a subprocess: ~3 min
@pytest.mark.timeout(1500)
def test_1_3_1_with_its_shipped_sglang_is_checked_on_radix_cache_and_names_10982():
    """1.3.1 x 0.5.14, the pair a 1.3.1 deployment runs: its server serves from RadixCache (no
    unified_cache package), its dynamo.sglang imports there, and its card is #10982 itself."""
    sglang, env = _shipped_pair_env("1.3.1")
    assert sglang == "0.5.14"
    report = _check_in(env, "--property", "card", "--property", "pages", "--property", "tier", "--examples", "15")
    assert report["cache"] == "radix" and report["versions"]["sglang"] == "0.5.14"
    rows = {(r["prop"], r["mode"], r["variant"]): r for r in report["rows"]}
    card = rows["card", "eagle", "base"]
    assert card["cause_name"] == "ROUTER_EAGLE_OFF" and card["counterexample"] == "EAGLE3"
    assert "Dynamo #10982" in card["detail"] and "CARD_EAGLE_OFF" in card["detail"]
    assert card["class"] == "cache-blind" and report["exit"] == 1  # a real cache-blind regression still fails check
    assert rows["card", "plain", "base"]["mismatches"] == 0
    # SGLang's real RadixCache ran: plain traffic aligned, tenants named by what each side drops
    for mode in ("plain", "eagle"):
        assert rows["pages", mode, "base"]["cases"] > 0 and rows["pages", mode, "base"]["mismatches"] == 0
        assert rows["pages", mode, "lora"]["cause_name"] == "LORA_NOT_IN_EVENTS"
        assert rows["pages", mode, "namespace"]["cause_name"] == "NAMESPACE_DROPPED"  # 1.3.1's binding has no namespace
        assert rows["tier", mode, "base"]["skipped"] and rows["tier", mode, "base"]["cases"] == 0


@pytest.mark.slow  # installs (or reuses) ai-dynamo 1.0.2 and sglang 0.5.9, then checks them in a subprocess
@pytest.mark.timeout(1500)
def test_1_0_2_with_its_shipped_sglang_is_checked_on_radix_cache():
    """1.0.2 x 0.5.9: 0.5.9's radix_cache imports CUDA-only host-copy ops it never calls (the import
    shim lets it load), and its RadixCache runs: plain pages aligned, the LoRA gap named."""
    sglang, env = _shipped_pair_env("1.0.2")
    assert sglang == "0.5.9"
    report = _check_in(env, "--property", "pages", "--mode", "plain", "--examples", "15")
    assert report["cache"] == "radix" and report["versions"]["sglang"] == "0.5.9"
    rows = {r["variant"]: r for r in report["rows"]}
    assert rows["base"]["cases"] > 0 and rows["base"]["mismatches"] == 0
    assert rows["lora"]["cause_name"] == "LORA_NOT_IN_EVENTS" and rows["namespace"]["cause_name"] == "NAMESPACE_DROPPED"


@pytest.mark.slow  # installs (or reuses) ai-dynamo 1.4.2 and its shipped sglang: ~2 min
@pytest.mark.timeout(1500)
def test_1_4_2_with_its_shipped_sglang_registers_every_eagle_algorithm():
    """The negative twin: from 1.4.0 the card asks SGLang's own is_eagle(), so no #10982."""
    _sglang, env = _shipped_pair_env("1.4.2")
    report = _check_in(env, "--property", "card")
    assert [(r["mode"], r["cases"] > 0, r["mismatches"]) for r in report["rows"]] == [("plain", True, 0), ("eagle", True, 0)]
    assert not any("#10982" in (r["detail"] or "") for r in report["rows"])


def test_live_column_and_json_when_asked_for():
    rows = [PairResult("1.6.1", "0.5.21", "misaligned", shipped=True,
                       live={"verdict": "pass", "detail": "PASS: all assertions hold", "seconds": 150.0}),
            PairResult("1.5.1", "0.5.18", "aligned", live={"verdict": "skipped", "detail": "x", "seconds": 0.0})]
    lines = table(rows).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[-1] == "live:disagg-eagle"
    assert [c.strip() for c in lines[2].strip("|").split("|")][-1] == "pass"
    assert rows[0].as_json()["live"]["verdict"] == "pass"
    assert "live" not in PairResult("1.6.1", "0.5.23", "aligned").as_json()
    assert "live:disagg-eagle" not in table([PairResult("1.6.1", "0.5.23", "aligned")])


def test_live_rows_say_why_a_pair_cannot_run_live():
    from kvalign.verify.report.matrix import installed, live_command, live_problem, run_live

    other = run_live("1.5.1", "0.5.18")  # another Dynamo runs fake workers, keyed by the environment's SGLang
    assert other["verdict"] == "skipped" and "key pages with the environment's SGLang" in other["detail"], other
    assert live_command("1.5.1", installed("sglang") or "") == ["e2e", "run", "--engine", "fake-cpu", "--dynamo", "1.5.1",
                                                               "--bind-host", "127.0.0.1"]
    assert live_problem("1.5.1", installed("sglang") or "") is None
    unsupported = live_problem(installed("ai-dynamo") or "", "0.5.17")
    assert unsupported is not None and "supports sglang" in unsupported


def test_a_credit_skew_is_an_advisory_and_a_property_that_ran_nowhere_is_never_aligned(monkeypatch, tmp_path):
    """Issue 36: a pair whose only finding is a credit skew is aligned (exit 0), its cell names the class; a
    pair whose dp rows were all n/a says "not run: dp", where it once read "aligned" beside an n/a cell."""
    skew = {"prop": "servable", "mode": "plain", "variant": "base", "mismatches": 3, "cause_name": "HOST_CREDIT_NOT_SERVABLE",
            "detail": "d", "class": "credit-skew", "event_format": "default"}
    na = {"prop": "dp", "mode": "plain", "variant": "pure-dp4", "mismatches": 0, "cause_name": None, "detail": None,
          "skipped": "the release places no DP ranks", "event_format": "default"}
    blind = {**skew, "prop": "hash", "cause_name": "ROUTER_EAGLE_OFF", "class": "cache-blind"}
    monkeypatch.setattr(matrix, "ensure_release", lambda kind, version, log=None: None)
    from kvalign.verify.report import finding_status

    monkeypatch.setattr(finding_status, "LIVE_RECORDS", tmp_path)  # no recorded live run: no "reproduced live" mark

    def pair(rows):
        report = json.dumps({"aligned": True, "rows": rows})
        monkeypatch.setattr(matrix, "_run_check", lambda cmd, env: subprocess.CompletedProcess(cmd, 0, report + "\n", ""))
        return matrix.run_pair("1.6.1", "0.5.23", examples=1, ingest_examples=1)

    advisory = pair([skew, na])
    assert advisory.verdict == "aligned" and matrix.exit_code([advisory]) == 0 and advisory.not_run == ["dp"]
    assert matrix.shown_verdict(advisory) == "aligned (credit-skew advisory; not run: dp)"
    lines = table([advisory]).splitlines()
    cells = dict(zip([c.strip() for c in lines[0].strip("|").split("|")], [c.strip() for c in lines[2].strip("|").split("|")]))
    assert cells["servable:plain"] == "HOST_CREDIT_NOT_SERVABLE (credit-skew)" and cells["dp:plain"] == "n/a"
    assert result_from_row(advisory.as_json()).not_run == ["dp"]
    assert "HOST_CREDIT_NOT_SERVABLE (servable; credit-skew)" in matrix.render_markdown([advisory], "cmd")
    blinded = pair([skew, blind])
    assert blinded.verdict == "misaligned" and matrix.exit_code([blinded]) == 1


def test_only_a_recorded_live_run_marks_a_cause_reproduced_live(tmp_path, monkeypatch):
    """The mark comes from a run's record under docs/findings/live/ (never a hand-kept table); the control:
    the same record of a run that did not name the cause marks nothing."""
    from kvalign.verify.report import finding_status

    monkeypatch.setattr(finding_status, "LIVE_RECORDS", tmp_path)
    row = PairResult("1.5.1", "0.5.23", "misaligned", [
        {"property": "dp", "mode": "plain", "variant": "pure-dp2", "cause": "DP_RANK_UNSUBSCRIBED", "detail": "x"},
        {"property": "hash", "mode": "plain", "variant": "base", "cause": "NAMESPACE_DROPPED", "detail": "x"}])
    record = {"cause": "DP_RANK_UNSUBSCRIBED", "ai-dynamo": "1.5.1", "sglang": "0.5.23", "command": "kvalign e2e x",
              "exit": 1, "named": "DP_RANK_UNSUBSCRIBED", "reproduced": True, "recorded": "2026-12-07"}
    for reproduced, mark in ((True, "DP_RANK_UNSUBSCRIBED (dp; reproduced live)"), (False, "DP_RANK_UNSUBSCRIBED (dp),")):
        (tmp_path / "DP_RANK_UNSUBSCRIBED-1.5.1-0.5.23.json").write_text(json.dumps({**record, "reproduced": reproduced}))
        text = matrix.render_markdown([row], "cmd")
        assert mark in text and "NAMESPACE_DROPPED (hash) |" in text, text
