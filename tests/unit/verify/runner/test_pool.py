"""``check --jobs N``: the same report whatever N, and a failing worker named, exit 2, never a hang.

Each run here is the ``kvalign`` command in a subprocess, as a user runs it: it imports Dynamo and
SGLang before it forks the workers, so each run costs seconds of CPU (``slow``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvalign.verify.runner.pool import usable_cores

ROOT = Path(__file__).resolve().parents[4]
HERE = Path(__file__).resolve().parent


def _check(*argv: str, tmp_path: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
               KVALIGN_LOG_DIR=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "kvalign", "check", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def _rows(out: str) -> list[dict]:
    """The report's rows without what differs between any two runs: timings, and the loopback ports the
    dp rows' details name (each run binds free ports)."""
    rows = json.loads(out)["rows"]
    return [{k: re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", v) if isinstance(v, str) else v
             for k, v in r.items() if k != "seconds"} for r in rows]


@pytest.mark.slow
def test_jobs_1_and_2_give_the_same_rows_for_one_seed(tmp_path):
    """Four search properties (15 jobs for two workers) through a router hasher that ignores EAGLE, so the
    eagle rows fail and their shrunk counterexamples are compared too: the rows in plan order, cases,
    causes and counterexamples equal."""
    argv = ("--json", "--examples", "10", "--seed", "7", "--router-hash", "kvalign.verify.misaligned:ignore_eagle",
            "--property", "hash", "--property", "pages", "--property", "overlap", "--property", "tenants")
    one, two = _check(*argv, "--jobs", "1", tmp_path=tmp_path), _check(*argv, "--jobs", "2", tmp_path=tmp_path)
    assert one.returncode == two.returncode == 1, one.stderr[-2000:] + two.stderr[-2000:]  # cache-blind rows
    a, b = _rows(one.stdout), _rows(two.stdout)
    assert len(a) == 30 and {r["prop"] for r in a} == {"hash", "pages", "overlap", "tenants"}
    assert sum(1 for r in a if r["counterexample"] and r["cause_name"] == "ROUTER_EAGLE_OFF") >= 8
    assert a == b


@pytest.mark.slow
@pytest.mark.parametrize(("hasher", "said"), [
    ("broken_hashers:raises", r"row hash/eagle/\S+ failed in check worker \d: RuntimeError: a hasher bug"),
    ("broken_hashers:dies", r"check worker \d was killed by signal 9 while running hash/eagle/\S+"),
])
def test_a_failing_worker_names_its_row_and_exits_2(tmp_path, hasher, said):
    res = _check("--property", "hash", "--examples", "5", "--jobs", "2", "--router-hash", hasher, tmp_path=tmp_path,
                 timeout=300)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("kvalign: error: ")]
    assert res.returncode == 2 and len(errors) == 1 and re.search(said, errors[0]), res.stderr
    assert "Traceback" not in res.stderr


def test_the_default_is_the_usable_cores():
    assert usable_cores() == len(os.sched_getaffinity(0))
