"""Which tests pytest-xdist must keep together on one worker, read from a test's node id alone.

The scheduler (``tests/conftest.py``) runs in the controller, which never collects, so all it has
is the node id. A unit file is one scope (its module fixtures are set up once), but for the files
that share the multimodal oracles (one scope), those that start vLLM's interpreter (one scope),
those that read the installed pair's matrix cell (one scope), those that share Dynamo 1.0.2's probe
child (one scope) and those that share the CPU stand-in's worker child per SGLang release (one scope). The files
that import SGLang in the test process (:data:`SGLANG_FILES`) go only to the first :data:`SGLANG_WORKERS`
workers, so the others never pay its import. The live tests
(``tests/e2e/``) form two scopes:

* **the real engine**: every test that starts real SGLang CPU workers (``test_fuzz.py``, and any
  test named ``test_real_engine_*``). One after the other on one worker: a real-engine cluster
  start is CPU-bound (SGLang's scheduler and detokenizer import torch), and two at once on two
  cores would stretch both past the bounds their waits were measured for.
* **the fake workers**: the rest of ``tests/e2e/``, kvalign's fake CPU workers behind the real
  frontend and router, mostly waiting on requests. One worker, so each shared cluster
  configuration (:class:`kvalign.live.cluster.shared.SharedClusters`, one pool per worker
  process) starts once; beside the real engine, as unit files already run beside it.

``tests/e2e/conftest.py`` refuses a collection where a test that asks for the real engine's
fixtures would land in the fake-worker scope.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

REAL_ENGINE = "live: real engine"
FAKE_WORKERS = "live: fake workers"
#: the live scopes, longest first: handed out before any unit file
LIVE_SCOPES = (REAL_ENGINE, FAKE_WORKERS)
#: fixtures that start or need the real SGLang engine on CPU
REAL_ENGINE_FIXTURES = frozenset({"sglang_cpu_engine", "shipped_release"})
REAL_ENGINE_FILES = frozenset({"tests/e2e/test_fuzz.py", "tests/e2e/test_vllm_cpu.py"})
#: unit files sharing the ``mm_oracles`` session fixture (Dynamo's frontend process and SGLang's
#: multimodal processor, 20-40 s of CPU to start): one scope, so they start once per session
MM_ORACLES = "unit: multimodal oracles"
MM_ORACLE_FILES = frozenset({"tests/unit/oracles/test_frontend_mm.py", "tests/unit/oracles/test_sglang_mm.py",
                             "tests/unit/verify/props/mm/test_mm.py"})

#: unit files sharing the ``installed_cell`` session fixture (the installed pair's ``kvalign matrix --cell --json``
#: run, about 15 CPU-s: tests/unit/installed_cell.py): one scope, so it runs once per session
INSTALLED_CELL = "unit: the installed pair's matrix cell"
INSTALLED_CELL_FILES = frozenset({"tests/unit/verify/report/test_matrix_cells.py", "tests/unit/releases/test_local_build.py"})

#: unit files sharing the ``standin_children`` session fixture (one child per SGLang release with the CPU stand-in
#: loaded as in a worker, 10-13 CPU-s to start: tests/unit/standins/standin_child.py): one scope, so each release's
#: child starts once per session
STANDIN_CHILDREN = "unit: the CPU stand-in's worker children"
STANDIN_CHILDREN_FILES = frozenset({"tests/unit/standins/test_hicache_cpu_standin.py",
                                    "tests/unit/standins/test_sglang_cpu_standin.py",
                                    "tests/unit/standins/test_sglang_cpu_standin_releases.py"})

#: unit files sharing the ``dynamo_1_0_2_probes`` session fixture (one child in Dynamo 1.0.2's environment, its
#: SGLang publisher about 11 CPU-s to import: tests/unit/oracles/release_probes.py): one scope, so it runs once
DYNAMO_1_0_2_PROBES = "unit: Dynamo 1.0.2's probe child"
DYNAMO_1_0_2_PROBES_FILES = frozenset({"tests/unit/oracles/test_router_crosstalk.py",
                                       "tests/unit/oracles/test_router_recovery.py"})

#: unit files that start vLLM's real KVCacheManager in vLLM's interpreter (importing vLLM is about 12 s of
#: CPU): one scope, so one worker imports it once and each later engine reuses that child whatever its
#: block size (:data:`kvalign.oracles.vllm._IDLE`). Which files, by a rule, not a list: a unit file named
#: ``test_vllm_*.py`` or under :data:`VLLM_DIR`. ``tests/unit/conftest.py`` fails a test that starts a vLLM
#: child from a file outside it.
VLLM_ORACLES = "unit: vLLM oracles"
VLLM_DIR = "tests/unit/verify/props/vllm/"


def starts_vllm(path: str) -> bool:
    """Whether the unit file ``path`` (relative to the repository) belongs to the vLLM scope."""
    return path.startswith("tests/unit/") and (path.startswith(VLLM_DIR) or path.rpartition("/")[2].startswith("test_vllm_"))


def scope(nodeid: str) -> str:
    """The xdist scope of ``nodeid``: its file, or one of the two live scopes."""
    path, _, name = nodeid.partition("::")
    if path in MM_ORACLE_FILES:
        return MM_ORACLES
    if path in INSTALLED_CELL_FILES:
        return INSTALLED_CELL
    if path in STANDIN_CHILDREN_FILES:
        return STANDIN_CHILDREN
    if path in DYNAMO_1_0_2_PROBES_FILES:
        return DYNAMO_1_0_2_PROBES
    if starts_vllm(path):
        return VLLM_ORACLES
    if not path.startswith("tests/e2e/"):
        return path
    if path in REAL_ENGINE_FILES or "::test_real_engine" in f"::{name}":
        return REAL_ENGINE
    return FAKE_WORKERS


#: unit files whose fast tests import SGLang in the test process (``kvalign.oracles.sglang``, its publisher,
#: a ``check`` in-process): about 10 CPU-s per process (torch, transformers, torch._inductor under SGLang's
#: ``mem_cache``), paid once by each worker that runs one of them. Found by running the fast tier in one process,
#: once with every ``import`` naming SGLang recorded per file and once with SGLang's import refused (a test here
#: then skips or fails), and by the check below. Also the files whose fast tests import only torch or
#: transformers (:data:`HEAVY_IMPORTS`; about 2.2 and 1.4 CPU-s), which SGLang's import brings into these
#: workers anyway: found the same way, the other files' fast tests run with those imports refused
#: (2026-12-07). ``tests/unit/conftest.py`` fails a test that imports any of them from a file outside it; a
#: file listed that no longer needs them costs only balance. No test file imports them at module level, so
#: no worker's collection pays them (``tests/conftest.py``'s ``pytest_ignore_collect`` keeps the all-slow
#: files out of the fast tier's collection).
SGLANG_FILES = frozenset({
    "tests/unit/commands/test_cli_bad_input.py",
    "tests/unit/live/test_e2e_plan.py",
    "tests/unit/live/test_engine_model_kv_pair.py",
    "tests/unit/live/test_live_advertised.py",
    "tests/unit/live/test_live_capture.py",
    "tests/unit/live/test_live_cpu_worker.py",
    "tests/unit/live/test_live_fuzz_plan.py",
    "tests/unit/live/test_live_fuzz_storage.py",
    "tests/unit/live/test_live_gpu.py",
    "tests/unit/live/test_live_metrics.py",
    "tests/unit/live/test_live_model_dir.py",
    "tests/unit/live/test_live_sglang_cpu_worker.py",
    "tests/unit/live/test_live_sglang_gpu_worker.py",
    "tests/unit/live/test_live_sglang_worker.py",
    "tests/unit/live/test_live_topology.py",
    "tests/unit/model/test_events.py",
    "tests/unit/model/test_relay.py",
    "tests/unit/model/test_sglang_keys.py",
    "tests/unit/model/test_sglang_keys_cap.py",
    "tests/unit/oracles/test_admission.py",
    "tests/unit/oracles/test_hybrid_oracle.py",
    "tests/unit/oracles/test_relay_process.py",
    "tests/unit/oracles/test_router_pair.py",
    "tests/unit/oracles/test_router_path.py",
    "tests/unit/oracles/test_storage_oracle.py",
    "tests/unit/standins/test_hicache_cpu_standin.py",
    "tests/unit/standins/test_kv_pages.py",
    "tests/unit/standins/test_kv_transfer_standin.py",
    "tests/unit/standins/test_scheduler_standin.py",
    "tests/unit/standins/test_sglang_cpu_standin_releases.py",
    "tests/unit/standins/test_sglang_gpu_standin.py",
    "tests/unit/streams/test_capture.py",
    "tests/unit/streams/test_diagnose.py",
    "tests/unit/streams/test_diagnose_mm.py",
    "tests/unit/streams/test_diagnose_workers.py",
    "tests/unit/streams/test_fuzz_untrusted.py",
    "tests/unit/streams/test_replay.py",
    "tests/unit/streams/test_watch.py",
    "tests/unit/streams/test_watch_metrics.py",
    "tests/unit/suite/test_gpu_skip.py",
    "tests/unit/verify/engine/test_alignment.py",
    "tests/unit/verify/engine/test_impact.py",
    "tests/unit/verify/engine/test_property.py",
    "tests/unit/verify/engine/test_stateful.py",
    "tests/unit/verify/props/advertised/test_advertised.py",
    "tests/unit/verify/props/dp/test_check_dp.py",
    "tests/unit/verify/props/hybrid/test_hybrid.py",
    "tests/unit/verify/props/hybrid/test_impact_hybrid.py",
    "tests/unit/verify/props/storage/test_storage.py",
    "tests/unit/verify/props/tenants/test_tenants.py",
    "tests/unit/verify/props/test_check_card.py",
    "tests/unit/verify/props/test_registry.py",
    "tests/unit/verify/props/tier/test_check_tier.py",
    "tests/unit/verify/props/tier/test_servable.py",
    "tests/unit/verify/report/test_report.py",
    "tests/unit/verify/runner/test_check.py",
    "tests/unit/verify/runner/test_check_adapters.py",
})
#: a test file's module mark, when it is one of the marks the fast tier deselects (alone or first in a list)
WHOLE_FILE_MARK = re.compile(r"^pytestmark = \[?pytest\.mark\.(slow|e2e)\b", re.M)


def deselected_as_a_whole(path: Path) -> bool:
    """Whether the fast tier (``-m "not slow and not e2e"``) would deselect every test under ``path``: a test
    file whose module mark is ``slow`` or ``e2e`` (:data:`WHOLE_FILE_MARK`), or a folder of only such files.

    ``tests/conftest.py`` does not collect those in the fast tier. Every xdist worker collects every file it is
    given, so their module-level imports were paid three times for nothing: ``test_sglang_cpu_standin_kernels.py``'s
    torch (about 2.2 CPU-s a worker), the multimodal files' PIL and numpy, ``tests/e2e``'s conftest and modules
    (about 0.45 CPU-s a worker). The whole suite collects them as before."""
    if path.is_dir():
        files = list(path.rglob("test_*.py"))
        return bool(files) and all(map(deselected_as_a_whole, files))
    return path.suffix == ".py" and path.name.startswith("test_") and bool(WHOLE_FILE_MARK.search(path.read_text()))


#: workers that may import SGLang: the first to ask for work take the SGLang files (and, once those are gone,
#: any file); the others take only the rest, so the other workers never pay SGLang's import
SGLANG_WORKERS = 2


#: the unit scopes of several files, by name: such a scope imports SGLang if one of its files does
GROUPS = {MM_ORACLES: MM_ORACLE_FILES, INSTALLED_CELL: INSTALLED_CELL_FILES, STANDIN_CHILDREN: STANDIN_CHILDREN_FILES,
          DYNAMO_1_0_2_PROBES: DYNAMO_1_0_2_PROBES_FILES}


def imports_sglang(scope_name: str) -> bool:
    """Whether a test of this scope imports SGLang in its worker (the live scopes and the multimodal oracles do,
    and a scope of several files one of which is in :data:`SGLANG_FILES`)."""
    return (scope_name in SGLANG_FILES or scope_name in LIVE_SCOPES or scope_name == MM_ORACLES
            or bool(GROUPS.get(scope_name, frozenset()) & SGLANG_FILES))


def next_scope(queue: list[str], sglang_worker: bool) -> str | None:
    """The scope a worker takes next from ``queue`` (in the scheduler's order), or None: nothing it should run.

    A worker that may import SGLang takes an SGLang scope while one is left, then any; another worker takes only
    scopes that do not import SGLang, and is done when those are gone (the SGLang workers finish the rest)."""
    if sglang_worker:
        return next((s for s in queue if imports_sglang(s)), queue[0] if queue else None)
    return next((s for s in queue if not imports_sglang(s)), None)


#: unit tests (node ids) that imported SGLang in this process from a file outside :data:`SGLANG_FILES`
SGLANG_OUTSIDE: list[str] = []


#: the modules only :data:`SGLANG_FILES` may bring into a fast test's process: SGLang and the two it imports
HEAVY_IMPORTS = frozenset({"sglang", "torch", "transformers"})


def note_sglang_import_outside_scope(event: str, args: tuple[Any, ...]) -> None:
    """An audit hook (``tests/unit/conftest.py``): note a unit test that imports SGLang (or torch or transformers,
    :data:`HEAVY_IMPORTS`) from a file not listed.

    The scheduler keeps :data:`SGLANG_FILES` on :data:`SGLANG_WORKERS` workers, so a file that imported SGLang
    unlisted would make another worker pay the import, unseen. Python audits an import only when the module is
    first loaded, so this sees the test that brought SGLang into its process; the hook only notes it (raising
    would turn the import into an ``OracleUnavailable``, a skip), and ``tests/unit/conftest.py`` fails that
    test at its teardown (:func:`refuse_unlisted_sglang_import`).
    """
    if event != "import" or args[0] not in HEAVY_IMPORTS:
        return
    nodeid = os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" ")[0]
    if nodeid.startswith("tests/unit/") and not imports_sglang(scope(nodeid)):
        SGLANG_OUTSIDE.append(nodeid)


def refuse_unlisted_sglang_import(nodeid: str, *, slow: bool) -> None:
    """At a unit test's teardown: fail it if it imported SGLang from a file outside :data:`SGLANG_FILES`.

    A ``slow`` test is let through: it runs in the whole suite, whose two workers both may import SGLang."""
    if nodeid in SGLANG_OUTSIDE and not slow:
        raise RuntimeError(f"{nodeid} imports SGLang, torch or transformers, but its file is not in "
                           f"xdist_scopes.SGLANG_FILES: list it there (tests/xdist_scopes.py), or a worker kept "
                           f"from SGLang pays the import")


#: what ``kvalign.oracles.vllm.VllmEngine`` runs: vLLM's interpreter serving its real KVCacheManager
VLLM_CHILD = "kvalign.oracles.vllm_child"


def refuse_vllm_child_outside_scope(event: str, args: tuple[Any, ...]) -> None:
    """An audit hook (``tests/unit/conftest.py``): a unit test outside the vLLM scope may not start a vLLM child.

    The scheduler keeps the files that start vLLM's interpreter on one worker by their path
    (:func:`starts_vllm`), so its import is paid once per run; a file that started one from elsewhere
    would pay it again on another worker, unseen. Whatever starts the child (``vllm_paths``,
    ``VllmEngine``, a property's body), it is a ``subprocess.Popen`` of :data:`VLLM_CHILD` in the test's
    process, refused here before it starts, naming the rule.
    """
    if event != "subprocess.Popen":
        return
    argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
    if VLLM_CHILD not in map(str, argv):
        return
    nodeid = os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" ")[0]
    if nodeid.startswith("tests/unit/") and scope(nodeid) != VLLM_ORACLES:
        raise RuntimeError(f"{nodeid} starts a vLLM child, but its file is not in the vLLM scope "
                           f"(tests/xdist_scopes.py): name it test_vllm_*.py or move it under {VLLM_DIR}")
