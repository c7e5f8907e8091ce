"""``kvalign check --engine vllm`` as a user runs it: vLLM's hash, pages, ingest, tenants, mm, tiers, hybrid (sliding
window and Mamba), blocks, hashes (int) and events rows in the same table, classes and exit codes, every row's negative
control failing as it must; a verdict for workers with vLLM's default int block hashes, naming the bytes ones as not
run, and that property alone (what ``--all`` adds) a finding: exit 1. (The differential checks and their controls at the oracle level:
tests/unit/oracles/test_vllm_*.py, in the fast tier.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[5]


def _check(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "KVALIGN_LOG_DIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "kvalign", "check", "--engine", "vllm", *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env)


#: the rows of check --engine vllm's default property, in order (workers with vLLM's default int block hashes)
DEFAULT_ROWS = [("hash", "base"), ("pages", "base"), ("ingest", "base"), ("tenants", "lora"), ("tenants", "namespace"),
                ("tenants", "lora+namespace"), ("mm", "base"), ("tiers", "base"), ("hybrid", "base"), ("hybrid", "mamba"),
                ("blocks", "b16"), ("blocks", "b32"), ("blocks", "b64"), ("hashes", "int"), ("events", "map")]
#: each default row's control: (failed, cause)
CONTROLS = [(True, "LORA_DROPPED"), (True, "INGEST_STALE"), (True, "EVENTS_DROPPED"), *[(True, "TENANTS_SHARE_KEYS")] * 3,
            (True, "MM_DROPPED"), (True, "TIER_MISFILED"), *[(True, "INGEST_STALE")] * 2, *[(True, "BLOCK_SIZE")] * 3,
            (True, "EVENTS_DROPPED"), (True, "TENANTS_SHARE_KEYS")]
BYTES_SURFACE = "vLLM workers with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0"


@pytest.mark.slow  # vLLM engines and a Dynamo runtime in a child (about 3 min on two loaded cores)
def test_check_engine_vllm_is_aligned_for_int_hash_workers_and_names_the_bytes_ones_as_not_run(tmp_path):
    res = _check("--vllm-examples", "8", "--json", tmp_path=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    report = json.loads(res.stdout)
    rows = {(r["prop"], r["variant"]): r for r in report["rows"]}
    assert list(rows) == DEFAULT_ROWS
    assert all(r["status"] == "ok" and r["mode"] == "plain" and r["cases"] == 8 for r in rows.values())
    assert [(r["control"]["failed"], r["control"]["cause"]) for r in rows.values()] == CONTROLS
    assert report["aligned"] and report["scope"] == {"ran": ["vllm"], "not_run": [
        {"property": "vllm_bytes", "surface": BYTES_SURFACE}], "aligned_for": f"deployments without {BYTES_SURFACE}"}


@pytest.mark.slow  # the opt-in property alone: its row on a vLLM interpreter of its own (what --all adds to the run above;
# --all's selection of both properties is tests/unit/verify/engine/test_scope.py's, so the suite runs every row once)
def test_the_bytes_hashes_property_finds_its_finding_and_exits_1(tmp_path):
    res = _check("--property", "vllm_bytes", "--vllm-examples", "8", "--json", tmp_path=tmp_path)
    # exit 1: the hashes/bytes row's finding (VLLM_BYTES_HASHES_DROPPED, cache-blind)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    report = json.loads(res.stdout)
    rows = {(r["prop"], r["variant"]): r for r in report["rows"]}
    assert list(rows) == [("hashes", "bytes")]
    bytes_row = rows[("hashes", "bytes")]
    assert (bytes_row["status"], bytes_row["cause_name"], bytes_row["class"]) == (
        "finding", "VLLM_BYTES_HASHES_DROPPED", "cache-blind") and bytes_row["cases"] >= 1
    assert report["scope"]["ran"] == ["vllm_bytes"] and not report["aligned"]


def test_an_unknown_engine_is_a_usage_error(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "kvalign", "check", "--engine", "trtllm"], capture_output=True, text=True, timeout=60,
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 2 and "invalid choice: 'trtllm'" in res.stderr and "Traceback" not in res.stderr
