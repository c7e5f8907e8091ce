"""Which tests pytest-xdist must keep together on one worker, read from a test's node id alone.

The scheduler (``tests/conftest.py``) runs in the controller, which never collects, so all it has
is the node id. A unit file is one scope (its module fixtures are set up once), but for the files
that share the multimodal oracles (one scope). The live tests
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


#: unit files that start vLLM's real KVCacheManager in vLLM's interpreter (importing vLLM is about 12 s
#: of CPU): one scope, so one worker imports it once and each later engine reuses that child
#: (:data:`kvalign.oracles.vllm._IDLE`)
VLLM_ORACLES = "unit: vLLM oracles"
VLLM_ORACLE_FILES = frozenset({"tests/unit/oracles/test_vllm_hash.py", "tests/unit/oracles/test_vllm_pages.py",
                               "tests/unit/oracles/test_vllm_ingest.py", "tests/unit/oracles/test_vllm_tenants.py"})


def scope(nodeid: str) -> str:
    """The xdist scope of ``nodeid``: its file, or one of the two live scopes."""
    path, _, name = nodeid.partition("::")
    if path in MM_ORACLE_FILES:
        return MM_ORACLES
    if path in VLLM_ORACLE_FILES:
        return VLLM_ORACLES
    if not path.startswith("tests/e2e/"):
        return path
    if path in REAL_ENGINE_FILES or "::test_real_engine" in f"::{name}":
        return REAL_ENGINE
    return FAKE_WORKERS
