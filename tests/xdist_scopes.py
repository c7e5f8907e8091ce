"""Which tests pytest-xdist must keep together on one worker, read from a test's node id alone.

The scheduler (``tests/conftest.py``) runs in the controller, which never collects, so all it has
is the node id. A unit file is one scope (its module fixtures are set up once), but for the files
that share the multimodal oracles (one scope) and those that start vLLM's interpreter (one scope). The live tests
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
    if starts_vllm(path):
        return VLLM_ORACLES
    if not path.startswith("tests/e2e/"):
        return path
    if path in REAL_ENGINE_FILES or "::test_real_engine" in f"::{name}":
        return REAL_ENGINE
    return FAKE_WORKERS


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
