"""``kvalign e2e fuzz`` on real SGLang CPU workers (EAGLE3) behind the real router, as a user runs it.

One generated run must hold every invariant while exercising every rule (eviction, concurrency,
flushes, a lost batch, a restart); three live negative controls must fail for the right reason:
the router's eagle forced off (generated, shrunk: ``ROUTER_EAGLE_OFF``), the gap check off (a
replay script: the prediction ignores the batch the hop lost), and a hop that strips
``cache_salt`` from a tenant's requests (a replay script: ``TENANTS_SHARE_KEYS``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import OUT_ROOT, sglang_cpu_missing

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
SCRIPTS = Path(__file__).parent / "fuzz_scripts"


@pytest.fixture(autouse=True)
def _engine() -> None:
    missing = sglang_cpu_missing()
    if missing:
        pytest.skip(f"real SGLang engine cannot run on this CPU: {missing}")


def fuzz(name: str, *args: str) -> tuple[int, dict[str, Any], str]:
    """Run the CLI; returns (exit code, its JSON, stderr). The run dir is kept on failure."""
    run_dir = OUT_ROOT / f"fuzz-{name}-{os.getpid()}"
    proc = subprocess.run([sys.executable, "-m", "kvalign", "e2e", "fuzz", "--json", "--run-dir", str(run_dir), *args],
                          capture_output=True, text=True, timeout=1700)
    assert proc.returncode in (0, 1), f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def examples() -> str:
    """3 examples in CI (the default seed draws every rule); the nightly profile runs 10x."""
    return "30" if os.environ.get("HYPOTHESIS_PROFILE") == "nightly" else "3"


def test_generated_workload_holds_every_invariant() -> None:
    rc, out, err = fuzz("pass", "--examples", examples())
    assert rc == 0 and out["verdict"] == "pass", f"{out['failure']}\n{err[-3000:]}"
    assert out["requests"] >= 30
    assert all(v >= 1 for v in out["counts"].values()), out["counts"]
    assert all(v["checked"] >= 1 and v["failed"] == 0 for v in out["invariants"].values()), out["invariants"]


def test_negative_control_router_eagle_off_fails_naming_the_cause() -> None:
    """Seed 29's second example reaches a lost batch before any restart, so the failure shrinks
    on replays of seconds each (a restart costs a minute per replay)."""
    rc, out, err = fuzz("eagle-off", "--seed", "29", "--examples", "3", "--steps", "6", "--router-eagle", "off",
                        "--shrink-seconds", "60")
    assert rc == 1 and out["verdict"] == "fail", err[-3000:]
    f = out["failure"]
    assert f["invariant"] in ("router_matches_prediction", "engine_matches_index", "best_worker_chosen", "gap_diagnosed")
    assert f["cause"] == "ROUTER_EAGLE_OFF", f
    script = json.loads(Path(f["script"]).read_text())
    assert script["options"]["router_eagle"] is False and script["steps"]
    shutil.rmtree(out["run_dir"])  # the expected failure's captures: kept only if an assertion above failed


def test_negative_control_gap_check_off_fails_router_matches_prediction() -> None:
    rc, out, err = fuzz("gap-off", "--replay", str(SCRIPTS / "lost-batch.json"))
    assert rc == 1, err[-3000:]
    assert out["failure"]["invariant"] == "router_matches_prediction"
    assert out["counts"]["dropped_batches"] == 1
    shutil.rmtree(out["run_dir"])


def test_negative_control_a_hop_that_strips_cache_salt_fails_with_the_tenant_cause(tmp_path: Path) -> None:
    rc, out, err = fuzz("salt-stripped", "--replay", str(SCRIPTS / "salt-stripped.json"))
    assert rc == 1, err[-3000:]
    assert out["failure"]["invariant"] == "router_matches_prediction"
    assert out["failure"]["cause"] == "TENANTS_SHARE_KEYS", out["failure"]
    shutil.rmtree(out["run_dir"])
    # positive control: the same tenant's steps through an honest hop hold every invariant
    script = json.loads((SCRIPTS / "salt-stripped.json").read_text())
    script["options"]["strip_salt"] = False
    honest = tmp_path / "salt-kept.json"
    honest.write_text(json.dumps(script))
    rc, out, err = fuzz("salt-kept", "--replay", str(honest))
    assert rc == 0 and out["verdict"] == "pass", f"{out['failure']}\n{err[-3000:]}"
    assert out["invariants"]["router_matches_prediction"] == {"checked": 2, "failed": 0}
