"""Live: ``kvalign e2e fuzz --hicache --storage file`` on real ``dynamo.sglang`` CPU workers behind the real router.

The replayed script (``fuzz_scripts/storage-refill.json``) is one ``refill_storage`` step on 2
aggregated EAGLE3 workers, page 16, write_through, SGLang's ``file`` storage tier: a 49-token prompt
(3 pages), then pressure until the engine's events show it gone from device and host (its pages went
to the worker's storage directory on the way), then the prompt again. SGLang refills it from
storage (its split: ``storage``, 2 pages under the scheduler's cap), the router credited nothing
(no event named a page in storage), and the fuzz fails ``router_credits_engine_reuse`` with the
cause ``STORAGE_TIER_UNCREDITED``: ``check --property storage``'s finding, on the live engine. The
judgement's negative controls (the same shortfall with no storage refill) are unit tests
(``tests/unit/live/test_live_fuzz_storage.py``). About 45 s on the 2-core machine, most of it the
cluster's start.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import OUT_ROOT, sglang_cpu_missing
from kvalign.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
SCRIPT = Path(__file__).parent / "fuzz_scripts" / "storage-refill.json"


def test_real_engine_fuzz_storage_refill_is_storage_tier_uncredited(capsys: pytest.CaptureFixture[str]) -> None:
    missing = sglang_cpu_missing()
    if missing:
        pytest.skip(f"real SGLang engine cannot run on this CPU: {missing}")
    run_dir = OUT_ROOT / f"fuzz-storage-{os.getpid()}"
    rc = main(["e2e", "fuzz", "--replay", str(SCRIPT), "--json", "--run-dir", str(run_dir)])
    out = json.loads(capsys.readouterr().out)
    f, counts = out["failure"], out["counts"]
    assert rc == 1 and f is not None, f"the router's credit matched the engine's reuse: no storage refill seen; {out}"
    assert f["invariant"] == "router_credits_engine_reuse" and f["failing"] == ["router_credits_engine_reuse"], f
    assert f["cause"] == "STORAGE_TIER_UNCREDITED", f
    assert counts["storage_evicted_requeried"] == 1 and counts["storage_requeried"] == 1, counts
    assert counts["storage_refilled_pages"] >= 1, counts
    (refill,) = out["storage_refills"]
    assert refill["residency_at_routing"] == [0, 0] and refill["router_tokens"] == 0, refill  # in no tier the router indexes
    assert refill["engine_storage_tokens"] == refill["engine_tokens"] == f["engine_tokens"] > 0, refill
    assert any((run_dir / "storage" / "worker0").iterdir()), "the file backend wrote no page"
    shutil.rmtree(run_dir, ignore_errors=True)
