"""tests/xdist_scopes.py: the node id alone decides which tests share an xdist worker."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import xdist_scopes
from xdist_scopes import (DYNAMO_1_0_2_PROBES, FAKE_WORKERS, INSTALLED_CELL, MM_ORACLES, REAL_ENGINE, STANDIN_CHILDREN,
                          VLLM_CHILD, VLLM_ORACLES, scope)

ROOT = Path(__file__).resolve().parents[3]


def test_a_unit_file_is_its_own_scope():
    assert scope("tests/unit/model/test_hashing.py::test_block_hashes_equal_router_binding[1]") == "tests/unit/model/test_hashing.py"


def test_real_engine_tests_share_one_scope_by_file_or_name():
    assert scope("tests/e2e/test_fuzz.py::TestShippedPair::test_lost_removal_fails_no_stale_credit") == REAL_ENGINE
    assert scope("tests/e2e/test_disagg_eagle.py::test_real_engine_cpu_routes_by_prefix_and_keeps_speculating") == REAL_ENGINE
    assert scope("tests/e2e/test_router_cpu_cli.py::test_real_engine_live_up_terminated_tears_every_process_down") == REAL_ENGINE


def test_other_live_tests_share_the_fake_worker_scope():
    for nodeid in ("tests/e2e/test_disagg_eagle.py::test_same_scenario_through_cpu_workers_passes",
                   "tests/e2e/test_router_cpu.py::test_prefix_requests_stick_to_one_worker_with_predicted_hit_rate[eagle]",
                   "tests/e2e/test_control_plane.py::test_prefix_requests_over_etcd_and_nats",
                   "tests/e2e/test_router_cpu_cli.py::test_live_up_interrupted_tears_everything_down[sigterm]"):
        assert scope(nodeid) == FAKE_WORKERS, nodeid
    # a name that merely mentions the engine later on is not a real-engine test
    assert scope("tests/e2e/test_router_cpu.py::test_fake_like_the_real_engine") == FAKE_WORKERS


def test_the_real_engine_goes_out_first():
    assert xdist_scopes.LIVE_SCOPES[0] == REAL_ENGINE


def test_the_multimodal_oracles_files_share_one_scope():
    """Their session fixture (a frontend process and SGLang's processor) then starts once."""
    for nodeid in ("tests/unit/oracles/test_frontend_mm.py::test_fields_of_a_preprocessed_request",
                   "tests/unit/oracles/test_sglang_mm.py::test_without_the_frontends_hash_sglang_hashes_the_pixels",
                   "tests/unit/verify/props/mm/test_mm.py::test_aligned_baseline_holds[True]"):
        assert scope(nodeid) == MM_ORACLES, nodeid
    assert scope("tests/unit/verify/runner/test_check.py::test_check_json_report") == "tests/unit/verify/runner/test_check.py"


@pytest.mark.parametrize(("fixture", "group"), [("installed_cell", INSTALLED_CELL),
                                              ("standin_children", STANDIN_CHILDREN),
                                              ("dynamo_1_0_2_probes", DYNAMO_1_0_2_PROBES)])
def test_the_files_that_share_a_session_child_share_one_scope(fixture, group):
    """Each such child (the installed pair's matrix cell, about 15 CPU-s; the stand-in's per release, 10-13; Dynamo
    1.0.2's probes, about 11) then runs once: every test file whose tests or fixtures ask for it by name is in the
    scope, and the scope holds no other file."""
    asking = re.compile(rf"^def \w+\([^)]*\b{fixture}\b", re.M)
    found = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests/unit").rglob("test_*.py") if asking.search(p.read_text())}
    assert found == xdist_scopes.GROUPS[group], found
    assert {scope(f"{p}::test_x") for p in found} == {group}


def test_files_beside_a_shared_child_keep_their_own_scope():
    assert scope("tests/unit/verify/report/test_matrix.py::test_x") == "tests/unit/verify/report/test_matrix.py"
    assert scope("tests/unit/standins/test_sglang_cpu_standin_kernels.py::test_x") == (
        "tests/unit/standins/test_sglang_cpu_standin_kernels.py")


def test_the_files_that_start_vllm_share_one_scope_by_their_path():
    """vLLM's interpreter (a 12 s import) then starts once per run, and each later engine reuses it."""
    for nodeid in ("tests/unit/oracles/test_vllm_hash.py::test_relay_keys_equal_the_model",
                   "tests/unit/oracles/test_vllm_encodings.py::test_x",
                   "tests/unit/verify/props/vllm/test_blocks.py::test_vllm_is_credited_what_it_reuses_at_each_block_size[16]",
                   "tests/unit/verify/props/vllm/test_tiers_chunks.py::test_x",
                   "tests/unit/verify/report/test_vllm_finding.py::test_x"):
        assert scope(nodeid) == VLLM_ORACLES, nodeid
    # a file that merely mentions vLLM elsewhere in its name is its own scope; the live vLLM test is the real engine's
    assert scope("tests/unit/live/test_live_vllm_cpu_worker.py::test_x") == "tests/unit/live/test_live_vllm_cpu_worker.py"
    assert scope("tests/e2e/test_vllm_cpu.py::test_x") == REAL_ENGINE


def test_every_unit_file_that_opens_a_vllm_worker_is_in_the_scope():
    """The files on disk today: each one that calls the helpers starting a vLLM child is scheduled with the others."""
    starters = ("open_vllm_worker(", "vllm_on_router(", "VllmEngine(", "vllm_worker(")
    found = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests/unit").rglob("test_*.py"))
             if p != Path(__file__).resolve() and any(s in p.read_text() for s in starters)]
    assert len(found) >= 11, found  # the files that start a child in the fast tier alone
    assert [p for p in found if scope(f"{p}::t") != VLLM_ORACLES] == []


def _popen_as(monkeypatch: pytest.MonkeyPatch, nodeid: str, argv: list[str]) -> None:
    monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{nodeid} (call)")
    xdist_scopes.refuse_vllm_child_outside_scope("subprocess.Popen", ("/env/bin/python", argv, None, None))


def test_a_vllm_child_is_refused_only_outside_the_scope(monkeypatch):
    child = ["/env/bin/python", "-m", VLLM_CHILD]
    _popen_as(monkeypatch, "tests/unit/oracles/test_vllm_pages.py::test_x[a b]", child)
    _popen_as(monkeypatch, "tests/unit/verify/props/vllm/test_vllm_mm.py::test_x", child)
    _popen_as(monkeypatch, "tests/e2e/test_vllm_cpu.py::test_x", child)  # the live scopes are their own
    _popen_as(monkeypatch, "tests/unit/verify/runner/test_check.py::test_x", ["/env/bin/python", "-m", "kvalign"])
    with pytest.raises(RuntimeError, match=r"test_check\.py::test_x starts a vLLM child.*name it test_vllm_\*\.py"):
        _popen_as(monkeypatch, "tests/unit/verify/runner/test_check.py::test_x", child)


def test_negative_control_this_file_cannot_start_a_vllm_child():
    """The hook is installed in the test process: a Popen naming the child, from this file, never starts."""
    with pytest.raises(RuntimeError, match="starts a vLLM child, but its file is not in the vLLM scope"):
        subprocess.Popen([sys.executable, "-c", "pass", "-m", VLLM_CHILD])


def test_only_the_sglang_workers_take_the_files_that_import_sglang():
    """The others never import it (about 10 CPU-s a process); the SGLang workers take the rest once theirs are
    gone."""
    plain = "tests/unit/model/test_hashing.py"
    sglang = "tests/unit/verify/engine/test_alignment.py"
    assert xdist_scopes.imports_sglang(sglang) and not xdist_scopes.imports_sglang(plain)
    assert xdist_scopes.imports_sglang(MM_ORACLES) and xdist_scopes.imports_sglang(REAL_ENGINE)
    assert not xdist_scopes.imports_sglang(VLLM_ORACLES)
    # a scope of several files imports SGLang when one of its files does (the stand-in's HiCache file does)
    assert xdist_scopes.STANDIN_CHILDREN_FILES & xdist_scopes.SGLANG_FILES
    assert xdist_scopes.imports_sglang(STANDIN_CHILDREN)
    assert not xdist_scopes.INSTALLED_CELL_FILES & xdist_scopes.SGLANG_FILES and not xdist_scopes.imports_sglang(INSTALLED_CELL)
    assert xdist_scopes.next_scope([plain, sglang], sglang_worker=True) == sglang
    assert xdist_scopes.next_scope([plain], sglang_worker=True) == plain
    assert xdist_scopes.next_scope([sglang, plain], sglang_worker=False) == plain
    assert xdist_scopes.next_scope([sglang, MM_ORACLES], sglang_worker=False) is None
    assert xdist_scopes.next_scope([], sglang_worker=True) is None


def test_every_listed_sglang_file_exists():
    assert sorted(f for f in xdist_scopes.SGLANG_FILES if not (ROOT / f).is_file()) == []


def _import_as(monkeypatch: pytest.MonkeyPatch, nodeid: str, module: str) -> list[str]:
    monkeypatch.setattr(xdist_scopes, "SGLANG_OUTSIDE", [])
    monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{nodeid} (setup)")
    xdist_scopes.note_sglang_import_outside_scope("import", (module, None, [], [], []))
    return xdist_scopes.SGLANG_OUTSIDE


def test_an_sglang_import_is_noted_only_from_a_unit_file_not_listed(monkeypatch):
    assert _import_as(monkeypatch, "tests/unit/verify/engine/test_alignment.py::test_x[a b]", "sglang") == []
    assert _import_as(monkeypatch, "tests/unit/oracles/test_sglang_mm.py::test_x", "sglang") == []  # the mm scope
    assert _import_as(monkeypatch, "tests/e2e/test_router_cpu.py::test_x", "sglang") == []  # the live scopes
    assert _import_as(monkeypatch, "tests/unit/model/test_hashing.py::test_x", "sglang.srt") == []  # only the first load
    assert _import_as(monkeypatch, "tests/unit/model/test_hashing.py::test_x", "torch.nn") == []
    assert _import_as(monkeypatch, "tests/unit/model/test_hashing.py::test_x", "numpy") == []
    assert _import_as(monkeypatch, "tests/unit/model/test_hashing.py::test_x[a b]", "sglang") == [
        "tests/unit/model/test_hashing.py::test_x[a b]"]
    for heavy in ("torch", "transformers"):  # what SGLang imports: the SGLang workers hold them, the other does not
        assert _import_as(monkeypatch, "tests/unit/model/test_hashing.py::test_x", heavy) == [
            "tests/unit/model/test_hashing.py::test_x"]
        assert _import_as(monkeypatch, "tests/unit/live/test_engine_model_kv_pair.py::test_x", heavy) == []


def test_negative_control_the_noted_test_fails_at_its_teardown(monkeypatch):
    """What tests/unit/conftest.py's teardown hook calls: the noted fast test fails naming the list; a slow one
    (the whole suite's two workers may both import SGLang) and any other test pass."""
    nodeid = "tests/unit/model/test_hashing.py::test_x"
    assert _import_as(monkeypatch, nodeid, "sglang") == [nodeid]
    xdist_scopes.refuse_unlisted_sglang_import("tests/unit/model/test_hashing.py::test_y", slow=False)
    xdist_scopes.refuse_unlisted_sglang_import(nodeid, slow=True)
    with pytest.raises(RuntimeError, match=r"test_hashing\.py::test_x imports SGLang, torch or transformers, but its "
                                           r"file is not in xdist_scopes\.SGLANG_FILES"):
        xdist_scopes.refuse_unlisted_sglang_import(nodeid, slow=False)


def test_the_fast_tier_skips_only_what_it_would_deselect_as_a_whole(tmp_path):
    """What ``tests/conftest.py``'s ``pytest_ignore_collect`` asks in the fast tier: a file whose module mark is
    ``slow`` or ``e2e`` (alone or first in a list) is not imported, nor a folder of only such files; a file with
    one fast test, another module mark, or a slow mark on its tests alone is, and so is a folder holding one."""
    files = {"test_all_slow.py": "import pytest\n\npytestmark = pytest.mark.slow\n\ndef test_a(): pass\n",
             "test_e2e.py": "import pytest\n\npytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]\n",
             "test_gpu.py": "import pytest\n\npytestmark = [pytest.mark.gpu_1, pytest.mark.slow]\n",
             "test_some_slow.py": "import pytest\n\n@pytest.mark.slow\ndef test_a(): pass\n\ndef test_b(): pass\n",
             "helper.py": "import pytest\n\npytestmark = pytest.mark.slow\n"}
    for name, text in files.items():
        (tmp_path / "mixed" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "mixed" / name).write_text(text)
    got = [n for n in sorted(files) if xdist_scopes.deselected_as_a_whole(tmp_path / "mixed" / n)]
    assert got == ["test_all_slow.py", "test_e2e.py"]
    assert not xdist_scopes.deselected_as_a_whole(tmp_path / "mixed")
    (tmp_path / "live").mkdir()
    for name in ("test_all_slow.py", "test_e2e.py", "helper.py"):
        (tmp_path / "live" / name).write_text(files[name])
    assert xdist_scopes.deselected_as_a_whole(tmp_path / "live")
    assert xdist_scopes.deselected_as_a_whole(ROOT / "tests" / "e2e")  # its conftest and modules: not imported
    assert not xdist_scopes.deselected_as_a_whole(ROOT / "tests" / "unit")
    assert xdist_scopes.deselected_as_a_whole(ROOT / "tests/unit/standins/test_sglang_cpu_standin_kernels.py")
