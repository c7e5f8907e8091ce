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

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

REAL_ENGINE = "live: real engine"
FAKE_WORKERS = "live: fake workers"
#: the live scopes, longest first: handed out before any unit file
LIVE_SCOPES = (REAL_ENGINE, FAKE_WORKERS)
#: fixtures that start or need the real SGLang engine on CPU
REAL_ENGINE_FIXTURES = frozenset({"sglang_cpu_engine", "shipped_release"})
REAL_ENGINE_FILES = frozenset({"tests/e2e/test_fuzz.py"})
#: unit files sharing the ``mm_oracles`` session fixture (Dynamo's frontend process and SGLang's
#: multimodal processor, 20-40 s of CPU to start): one scope, so they start once per session
MM_ORACLES = "unit: multimodal oracles"
MM_ORACLE_FILES = frozenset({"tests/unit/oracles/test_frontend_mm.py", "tests/unit/oracles/test_sglang_mm.py",
                             "tests/unit/verify/test_mm.py"})


def scope(nodeid: str) -> str:
    """The xdist scope of ``nodeid``: its file, or one of the two live scopes."""
    path, _, name = nodeid.partition("::")
    if path in MM_ORACLE_FILES:
        return MM_ORACLES
    if not path.startswith("tests/e2e/"):
        return path
    if path in REAL_ENGINE_FILES or "::test_real_engine" in f"::{name}":
        return REAL_ENGINE
    return FAKE_WORKERS


#: each test's seconds in a recent whole-suite run (``bench/suite_times.py --split-durations``)
DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_S = 0.5  # a test the durations file does not know yet


def longest_first(scopes: Mapping[str, Iterable[str]], durations: Mapping[str, float] | None = None) -> list[str]:
    """``scopes`` (scope -> its node ids) ordered by their known seconds, longest first: handed out
    in that order, the long files start early and the short ones fill the workers' tails. In the
    order xdist uses (most tests first), a file of few long tests came last and its worker finished
    up to 11 s after the others in the fast tier."""
    if durations is None:
        try:
            durations = json.loads(DURATIONS.read_text())
        except (OSError, ValueError):
            durations = {}
    seconds = {s: sum(durations.get(n, UNKNOWN_S) for n in ids) for s, ids in scopes.items()}
    return sorted(scopes, key=lambda s: -seconds[s])
