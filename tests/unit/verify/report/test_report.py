"""``kvalign report``: one finding, as a Markdown report, from real runs of the real wheels.

The shipped pair ai-dynamo 1.6.1 x sglang 0.5.21 is installed into the matrix's per-version cache
(skipped with the reason when the package index cannot be reached); the report must show the
LoRA finding end to end: SGLang's own event bytes without a LoRA name, the router indexing the
adapter's page under the base-model hash, and the source lines in both wheels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvalign.model.causes import Cause
from kvalign.cli import main
from kvalign.verify.report.finding import ANCHORS, Anchor, locate

ROOT = Path(__file__).resolve().parents[4]


def _kvalign(*argv: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "kvalign", *argv], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize(("argv", "message"), [
    (["report", "LORA_MISSING"], "unknown finding 'LORA_MISSING'"),
    (["report", "LORA_NOT_IN_EVENTS", "--sglang", "0.5;x"], "--sglang takes one release version"),
    (["report", "LORA_NOT_IN_EVENTS", "--examples", "0"], "must be >= 1"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and message in err


def test_anchors_are_found_in_the_installed_sglang_or_said_missing(sglang_available):
    """Against the environment's SGLang (0.5.23, which names LoRA in its events): each anchor is
    either located with its enclosing function or reported missing, never invented."""
    for found in map(locate, ANCHORS[Cause.LORA_NOT_IN_EVENTS]):
        assert found["line"] is not None or found["missing"]
        if found["line"]:
            assert found["text"] in found["source"] and found["function"]
    gone = locate(Anchor("sglang", "srt/no_such_module.py", "x", "why"))
    assert gone["line"] is None and gone["missing"] == "file not in this release"


@pytest.mark.slow  # a child that installs (or reuses) ai-dynamo 1.6.1 x sglang 0.5.21 and runs both: 20-30 s
@pytest.mark.timeout(900)
def test_lora_report_on_the_shipped_pair_1_6_1_x_0_5_21(tmp_path):
    out = tmp_path / "report.md"
    res = _kvalign("report", "LORA_NOT_IN_EVENTS", "--dynamo", "1.6.1", "--sglang", "0.5.21", "--mode", "plain",
                   "--examples", "20", "--out", str(out))
    if res.returncode == 2 and "cannot install" in res.stderr:
        pytest.skip(f"the 1.6.1 x 0.5.21 wheels cannot be installed here: {res.stderr.strip().splitlines()[-1]}")
    assert res.returncode == 0, res.stderr[-2000:]
    text = out.read_text()
    assert "ai-dynamo 1.6.1" in text and "sglang 0.5.21" in text
    assert '"lora_id": null' in text and "lora_name" not in text.split("decoded (msgpack)")[1].split("```")[1]
    indexed = text.split("## What the router indexed")[1].split("##")[0]
    assert "| yes |" in indexed  # the adapter's page is indexed under its base-model hash
    assert "schedule_batch.py`:" in text and "in `Req.__init__`" in text
    assert "events.py`:" in text and "KVCacheEventRecorder.record_store" in text
    assert "kvalign report LORA_NOT_IN_EVENTS --dynamo 1.6.1 --sglang 0.5.21" in text


@pytest.mark.parametrize(("cause", "places"), [
    # the threshold, its check, the scheduler's cap, the router's host weight
    (Cause.HOST_CREDIT_NOT_SERVABLE, [("srt/mem_cache/unified_radix_cache.py", "UnifiedRadixCache.init_hicache"),
                                      ("srt/mem_cache/unified_radix_cache.py", "UnifiedRadixCache._load_back_transfers"),
                                      ("srt/managers/schedule_batch.py", "Req._compute_max_prefix_len"),
                                      ("_core.pyi", "KvRouterConfig.__init__")]),
    # the write that records no event, the router's disk weight (and the medium, Dynamo's Mooncake-only route)
    (Cause.STORAGE_TIER_UNCREDITED, [("srt/mem_cache/unified_radix_cache.py", "UnifiedRadixCache.write_backup_storage"),
                                     ("_core.pyi", "KvRouterConfig.__init__")]),
], ids=["host-credit", "storage"])
def test_report_anchors_are_found_in_the_installed_pair(sglang_available, cause, places):
    """Every source line the report quotes exists in the installed 1.6.1 x 0.5.23 wheels, in the function
    it names: a report cannot cite a line that moved."""
    from kvalign.standins.hicache import version_problem

    if version_problem(sglang_available):
        pytest.skip(version_problem(sglang_available))
    found = [locate(a) for a in ANCHORS[cause]]
    assert all(f["line"] and f["text"] in f["source"] for f in found), [f for f in found if not f["line"]]
    where = {(f["path"], f["function"]) for f in found}
    assert set(places) <= where, where


@pytest.mark.slow  # a search of the HiCache state machine and a replay through the real router: 60-90 s
@pytest.mark.timeout(900)
def test_host_credit_report_on_the_installed_pair_installs_nothing(tmp_path, sglang_available):
    """1.6.1 x 0.5.23 is the environment's own pair: the report runs on it with an empty wheel cache and
    installs no release into it."""
    from kvalign.standins.hicache import version_problem

    if version_problem(sglang_available):
        pytest.skip(version_problem(sglang_available))
    out, cache = tmp_path / "report.md", tmp_path / "wheels"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               KVALIGN_WHEEL_CACHE=str(cache))
    res = subprocess.run([sys.executable, "-m", "kvalign", "report", "HOST_CREDIT_NOT_SERVABLE", "--dynamo", "1.6.1",
                          "--sglang", "0.5.23", "--mode", "plain", "--examples", "15", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    # no release directory (pair_env only points SGLang's JIT build at cache/torch-extensions)
    assert not [p.name for p in cache.glob("*") if p.name.startswith(("ai-dynamo-", "sglang-"))]
    assert "installing" not in res.stderr
    text = out.read_text()
    # what a maintainer reads first: the pair's status, the class with its bound and measured routing impact, live
    head = text.split("**Pair:**")[0]
    assert "**Status:** not shipped together: ai-dynamo 1.6.1's `sglang` extra pins sglang 0.5.21, not 0.5.23" in head
    assert "**Class:** credit-skew, an advisory" in head and "bound: at most" in head and "the router" in head
    # from its recorded run (docs/findings/live/), never a hand-kept table
    assert ("**Live:** reproduced live: `kvalign e2e fuzz --replay tests/e2e/fuzz_scripts/hicache-declined.json --json` "
            "(exit 1, HOST_CREDIT_NOT_SERVABLE, ") in head
    assert "× sglang 0.5.23" in text and "`servable` property" in text
    steps = text.split("## Each step")[1].split("## The admitted request")[0]
    assert "BlockStored[CPU_PINNED" in steps and "BlockRemoved[GPU" in steps
    admitted = text.split("## The admitted request")[1].split("##")[0]
    assert "load_back_threshold` (10)" in admitted and "loads back 0" in admitted
    assert "the cap does not explain it" in admitted and "PrefillAdder.add_one_req" in admitted
    assert '"medium": "CPU_PINNED"' in text.split("## Event bytes on the wire")[1]
    assert "unified_radix_cache.py`:576 in `UnifiedRadixCache.init_hicache`" in text
    assert "kvalign report HOST_CREDIT_NOT_SERVABLE --dynamo 1.6.1 --sglang 0.5.23" in text


def test_the_routing_section_shows_every_k_and_a_tie_as_a_tie() -> None:
    """Issue 43: the report's routing table names, per k, the router's picks over repeated routings; a split
    is a tie (never 'reuses less'), and a storage row says which cause each wrong choice is owed to."""
    from kvalign.verify.report.finding import _render_routing

    def trial(k: int, picks: list[int], reused: list[int], changed: bool) -> dict:
        return {"k": k, "picks": picks, "reused": reused, "tie": min(picks) > 0, "changed": changed}

    m = {"page_size": 4, "storage_pages": 6, "prefetch_threshold": 4, "shared": False, "disk_weight": 0.25}
    routing = {"private": {"without_events": {**m, "trials": [trial(0, [22, 18], [24, 0], False),
                                                             trial(1, [0, 40], [24, 4], True),
                                                             trial(2, [0, 40], [24, 8], True)]},
                           "disk_events": {**m, "trials": [trial(0, [40, 0], [24, 0], False),
                                                           trial(1, [40, 0], [24, 4], False),
                                                           trial(2, [0, 40], [24, 8], True)]},
                           "missing_events_k": [1], "disk_weight_k": [2], "tie_k": [0]},
               "shared_cache_route": "not driven: no Mooncake here"}
    text = "\n".join(_render_routing(routing))
    assert "| 0 | 22 / 18 (tie) | 24 vs 0 | 40 / 0 (first) | 24 vs 0 | a tie |" in text, text
    assert "| 1 | 0 / 40 (other, reuses less) | 24 vs 4 | 40 / 0 (first) | 24 vs 4 | the missing events |" in text
    assert text.count("the disk weight |") == 1 and "not driven: no Mooncake here" in text
