"""What a report says first (issue 36): the pair's status, the finding's class and bound, the live run."""

from __future__ import annotations

import pytest

from kvalign.verify.report.finding_status import LIVE, NOT_LIVE, live_note, opening, pair_status


def test_the_1_5_1_dp_findings_are_not_reproduced_live_and_the_live_ones_name_their_command():
    assert live_note("DP_RANK_UNSUBSCRIBED", "1.5.1", "0.5.23") == NOT_LIVE
    assert live_note("DP_RANK_UNREGISTERED", "1.5.1", "0.5.23") == NOT_LIVE
    assert live_note("MM_PAD_WIDTH", "1.6.1", "0.5.23").startswith("reproduced live: `kvalign e2e mm`")
    assert live_note("STORAGE_TIER_UNCREDITED", "1.6.1", "0.5.23").startswith(
        "reproduced live: `kvalign e2e fuzz --engine sglang-cpu --hicache --storage file --json`")
    assert live_note("STORAGE_TIER_UNCREDITED", "1.6.1", "0.5.21") == NOT_LIVE
    assert live_note("LORA_NOT_IN_EVENTS", "1.6.1", "0.5.21") == NOT_LIVE  # no live run recorded: never assumed
    assert all(v is None or v[0].startswith("kvalign ") for v in LIVE.values())


def test_a_report_opens_with_the_pair_s_status_class_and_live_reproduction():
    """A credit skew's class line needs its bound and routing impact: an error naming them, never a report without."""
    data = {"cause": "DP_RANK_UNREGISTERED", "class": "cache-blind",
            "versions": {"ai-dynamo": "1.5.1", "ai-dynamo-runtime": "1.5.1", "sglang": "0.5.23"}}
    head = opening(data, "0.5.18")
    assert head[0].startswith("**Status:** not shipped together: ai-dynamo 1.5.1's `sglang` extra pins sglang 0.5.18")
    assert head[1].startswith("**Class:** cache-blind") and head[2] == "**Live:** not reproduced live.  "
    assert pair_status("1.5.1", "0.5.18", "0.5.18").startswith("shipped together")
    assert pair_status("1.0.2", "0.5.23", None).startswith("ai-dynamo 1.0.2 pins no SGLang release")
    with pytest.raises(ValueError, match="no bound / routing impact"):
        opening({**data, "cause": "HOST_CREDIT_NOT_SERVABLE", "class": "credit-skew"}, "0.5.21")
