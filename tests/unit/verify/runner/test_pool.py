"""``check --jobs N``: the same report whatever N, and a failing worker named, exit 2, never a hang.

Each run here is the ``kvalign`` command in a subprocess, as a user runs it: it imports Dynamo and
SGLang before it forks the workers, so each run costs seconds of CPU (``slow``).
"""

from __future__ import annotations

import heapq
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dataclasses import replace

from kvalign.verify.engine.property import Job, Options
from kvalign.verify.runner.check import plan, selected
from kvalign.verify.runner.pool import Schedule, usable_cores

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


def _simulate(jobs: list[Job], workers: int) -> dict[int, int]:
    """Which worker runs each job when each takes its ``cost`` in seconds: :meth:`Pool.run`'s hand-out
    (every free worker, lowest first, takes :meth:`Schedule.take`'s job; the first to finish takes next)."""
    schedule, ran, free = Schedule(jobs), {}, [(0.0, i) for i in range(workers)]
    while schedule:
        now, i = heapq.heappop(free)
        k = schedule.take(i)
        ran[k] = i
        heapq.heappush(free, (now + jobs[k].cost, i))
    return ran


def _default_plan() -> list[Job]:
    return plan(selected(None), ("default",), Options(page_size=16))


def test_jobs_sharing_a_set_up_run_on_the_worker_that_loaded_it():
    """card, advertised and the four dp jobs all import dynamo.sglang: on the default plan they run on one
    worker, and the jobs stay longest first otherwise (the two servable jobs start at once)."""
    jobs = _default_plan()
    sharing = [k for k, j in enumerate(jobs) if j.prop in ("card", "advertised", "dp")]
    assert len(sharing) == 6 and {jobs[k].shares for k in sharing} == {"registration"}
    ran = _simulate(jobs, 2)
    assert len({ran[k] for k in sharing}) == 1
    servable = [k for k, j in enumerate(jobs) if j.prop == "servable"]
    assert {ran[k] for k in servable} == {0, 1}
    assert sorted(ran) == list(range(len(jobs)))  # every job handed out once


def test_without_shares_the_registration_jobs_split_across_workers():
    """The negative control: the same plan without ``shares`` hands card and advertised to different
    workers, and the dp jobs to both (each worker would import dynamo.sglang), so the test above holds by
    ``shares`` alone."""
    jobs = [replace(j, shares=None) for j in _default_plan()]
    by_prop = {j.prop: k for k, j in enumerate(jobs)}
    ran = _simulate(jobs, 2)
    assert ran[by_prop["card"]] != ran[by_prop["advertised"]]
    assert {ran[k] for k, j in enumerate(jobs) if j.prop == "dp"} == {0, 1}


def test_a_free_worker_takes_a_shared_job_rather_than_wait():
    """Where only jobs of another worker's set-up remain, a free worker takes the longest of them."""
    jobs = [Job("a", ("plain",), cost=3.0, shares="x"), Job("b", ("plain",), cost=2.0, shares="x"),
            Job("c", ("plain",), cost=1.0)]
    schedule = Schedule(jobs)
    assert schedule.take(0) == 0  # worker 0 loads "x"
    assert schedule.take(1) == 2  # worker 1 skips b (x is worker 0's) for c
    assert schedule.take(1) == 1  # nothing else left: b, rather than wait
    assert not schedule
