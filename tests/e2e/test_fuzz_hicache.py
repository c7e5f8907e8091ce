"""Live HiCache: real ``dynamo.sglang`` CPU workers with SGLang's host tier on, behind the real router.

One aggregated cluster (2 EAGLE3 workers, page 4, ``--enable-hierarchical-cache
--hicache-write-policy write_back``; the host pool's pinning and transfer ops stood in by
:mod:`kvalign.standins.hicache_cpu`), started once for both tests and flushed between them:

* a twin that passes: a 5-page prompt whose last 3 pages device pressure pushed to host (12
  tokens, at or above SGLang's ``load_back_threshold`` of 10) is asked for again; SGLang loads the
  stretch back, and the router credited exactly what it reused;
* the finding: the same with 2 host-only pages (8 tokens, below the threshold, inside the
  scheduler's cap): SGLang declines the load-back and re-prefills them, the router credited them
  anyway, and the fuzz fails ``router_credits_engine_reuse`` naming ``HOST_CREDIT_NOT_SERVABLE``,
  router 16 tokens against the engine's 8, both read from the live surfaces (the frontend's raw
  credit counter with ``kv_hit_rate``; the response's ``cached_tokens`` with SGLang's own
  per-tier counter).

The generated runs (``kvalign e2e fuzz --hicache --page-size 4|16``) are in docs/live-fuzz.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import OUT_ROOT, sglang_cpu_missing
from kvalign.live.engines.hicache import HiCache
from kvalign.live.runs.fuzz.driver import FuzzDriver
from kvalign.live.runs.fuzz.options import FuzzOptions
from kvalign.live.runs.fuzz.plan import fuzz_cluster
from kvalign.live.runs.fuzz.machine import FuzzResult, replay

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
SCRIPTS = Path(__file__).parent / "fuzz_scripts"
OPTIONS = FuzzOptions(page_size=4, hicache=HiCache("write_back"))


@pytest.fixture(scope="module")
def hicache(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any, Path]]:
    missing = sglang_cpu_missing()
    if missing:
        pytest.skip(f"real SGLang engine cannot run on this CPU: {missing}")
    run_dir = OUT_ROOT / f"fuzz-hicache-{os.getpid()}"
    failed_before = request.session.testsfailed
    with fuzz_cluster(OPTIONS, run_dir) as (cluster, hop):
        yield cluster, hop, run_dir
    if request.session.testsfailed == failed_before:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        print(f"\nkvalign fuzz run dir kept: {run_dir}")


def _replay(live: tuple[Any, Any, Path], name: str) -> tuple[FuzzResult, dict[str, Any]]:
    cluster, hop, run_dir = live
    script = json.loads((SCRIPTS / name).read_text())
    assert OPTIONS.as_json()["hicache"] == script["options"]["hicache"]  # the script was written for this cluster
    with contextlib.ExitStack() as stack:
        log = stack.enter_context((run_dir / "progress.log").open("a"))
        driver = FuzzDriver(cluster, hop, OPTIONS, lambda m: print(m, file=log, flush=True))
        res = replay(driver, script, run_dir / f"replayed-{name}")
    return res, res.as_json()


def test_real_engine_hicache_loads_a_host_stretch_back_and_the_router_credits_it(hicache):
    res, out = _replay(hicache, "hicache-loaded.json")
    assert res.passed, out["failure"]
    counts = out["counts"]
    assert counts["evicted_to_host"] >= 3 and counts["host_requeried"] == 1 and counts["loaded_back"] == 1, counts
    (requery,) = out["host_requeries"]
    assert requery["host_only_tokens"] == 12 and requery["loaded_tokens"] == 12 and requery["engine_did"] == "load"
    assert requery["router_tokens"] == requery["engine_tokens"] == requery["device_tokens"] + 12
    assert out["invariants"]["router_tiers_match_engine"]["checked"] == out["requests"]


def test_real_engine_hicache_a_declined_load_back_the_router_credits_is_host_credit_not_servable(hicache):
    res, out = _replay(hicache, "hicache-declined.json")
    f = out["failure"]
    assert f is not None, "the router's host credit matched the engine's reuse: the declined load-back was not seen"
    assert f["invariant"] == "router_credits_engine_reuse" and f["failing"] == ["router_credits_engine_reuse"], f
    assert f["cause"] == "HOST_CREDIT_NOT_SERVABLE", f
    assert (f["router_tokens"], f["engine_tokens"]) == (16, 8), f
    requery = out["host_requeries"][-1]
    assert (requery["device_tokens"], requery["host_only_tokens"], requery["loaded_tokens"]) == (8, 8, 0), requery
    assert requery["prompt_tokens"] - 1 >= requery["device_tokens"] + requery["host_only_tokens"]  # not the cap
