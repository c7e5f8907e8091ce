"""The vLLM reports of the findings sharing an SGLang cause (:mod:`kvalign.verify.props.vllm.shared_report`):
their anchors found in the pinned vLLM and the installed Dynamo, who meets each (the image finding reached through
``dynamo.vllm``'s own paths, read from its source), the chunk finding's bound, and the measured trials as the
report's table takes them. No vLLM child runs here; the impact runs are the slow tests beside each measurement."""

from __future__ import annotations

import pytest

from kvalign.model.causes import CACHE_BLIND, CREDIT_SKEW, Cause, cause_class
from kvalign.verify.engine.trials import Trial
from kvalign.verify.props.vllm.hybrid_impact import VllmRoutingImpact
from kvalign.verify.props.vllm.report import CAUSES, _roots, locate
from kvalign.verify.props.vllm.reset_impact import ResetImpact, Served
from kvalign.verify.props.vllm.shared_report import FINDINGS, SHARED, chunk_bound, reset_bound, routing, tables


def test_the_shared_findings_and_their_classes():
    assert SHARED == {Cause.SWA_STATE_NOT_REUSABLE, Cause.MAMBA_STATE_NOT_REUSABLE, Cause.HOST_CREDIT_NOT_SERVABLE,
                      Cause.MM_IMAGE_REUSED}
    assert not SHARED & CAUSES
    assert {c: cause_class(c) for c in SHARED} == {Cause.SWA_STATE_NOT_REUSABLE: CACHE_BLIND,
                                                   Cause.MAMBA_STATE_NOT_REUSABLE: CACHE_BLIND,
                                                   Cause.HOST_CREDIT_NOT_SERVABLE: CREDIT_SKEW,
                                                   Cause.MM_IMAGE_REUSED: CACHE_BLIND}


def test_the_reset_is_a_vllm_cause_reported_the_same_way():
    """``VLLM_RESET_PUBLISHED_LATE`` carries no SGLang cause (``kvalign report`` takes it without ``--engine``),
    and is a credit skew: its stale credit ends with the worker's next step."""
    assert set(FINDINGS) == SHARED | {Cause.VLLM_RESET_PUBLISHED_LATE}
    assert Cause.VLLM_RESET_PUBLISHED_LATE not in CAUSES | SHARED
    assert cause_class(Cause.VLLM_RESET_PUBLISHED_LATE) == CREDIT_SKEW
    assert "`clear_kv_blocks`" in FINDINGS[Cause.VLLM_RESET_PUBLISHED_LATE].reach


@pytest.mark.parametrize("cause", sorted(FINDINGS, key=lambda c: c.name))
def test_anchors_are_found_in_the_pinned_releases(cause):
    from kvalign.releases.vllm_env import installed

    if not installed():
        pytest.skip("vLLM's environment is not installed here (scripts/setup.sh installs it)")
    roots = _roots()
    for found in (locate(a, roots) for a in FINDINGS[cause].anchors):
        assert found["line"] and found["text"] in found["source"], found


def test_the_image_finding_is_reached_through_dynamo_vllms_own_paths():
    """Not latent: Dynamo 1.6.1's worker hands vLLM unmarked identifiers (a client's ``multi_modal_uuids``, or its
    own blake3 digests when the frontend forwarded no hashes), and its frontend routes those by text prefix."""
    reach = FINDINGS[Cause.MM_IMAGE_REUSED].reach
    assert "latent" not in reach and "`multi_modal_uuids`" in reach and "`mm_processor_kwargs`" in reach
    paths = {a.path for a in FINDINGS[Cause.MM_IMAGE_REUSED].anchors if a.root == "dynamo"}
    assert paths == {"vllm/multimodal_utils/request_processor.py", "frontend/vllm_processor.py"}


def test_the_dynamo_anchors_of_the_image_finding_are_its_unmarked_paths():
    """The anchors the report cites are the lines that decide it, found by their text in the installed Dynamo."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("dynamo")
    root = Path(list(spec.submodule_search_locations)[0])
    lines = {a.text: locate(a, {"dynamo": root}) for a in FINDINGS[Cause.MM_IMAGE_REUSED].anchors
             if a.root == "dynamo"}
    assert all(found["line"] for found in lines.values()), lines
    assert lines["mm_uuids = _build_user_mm_uuids("]["line"] < lines["mm_uuids = compute_mm_uuids(multi_modal_data)"]["line"]


def test_only_the_chunk_finding_cites_an_upstream_thread():
    assert FINDINGS[Cause.HOST_CREDIT_NOT_SERVABLE].upstream.startswith("vllm-project/vllm#57159")
    assert FINDINGS[Cause.SWA_STATE_NOT_REUSABLE].upstream is None
    assert FINDINGS[Cause.MM_IMAGE_REUSED].upstream is None


def test_the_chunk_bound_is_a_chunk_less_one_block_at_the_host_weight():
    assert "at most 3 host blocks per request with 4 blocks a chunk" in chunk_bound(0.75)
    assert chunk_bound(0.75).endswith("x host weight 0.75 = 2.25 blocks of credit")


def test_the_routing_table_credits_the_finding_and_k_on_the_other():
    impact = VllmRoutingImpact(16, 3, 0, what="vLLM CPU tier of 4-block chunks",
                               trials=[Trial(0, (40, 0), (0, 0)), Trial(1, (40, 0), (0, 16))])
    table = routing(Cause.HOST_CREDIT_NOT_SERVABLE, impact)
    assert [t["credited"] for t in table["trials"]] == [[3, 0], [3, 1]]
    assert [t["changed"] for t in table["trials"]] == [False, True]
    assert table["state"].startswith("the first: vLLM CPU tier of 4-block chunks after the finding's steps, "
                                     "credited 3 block(s) of the query and reusing 0")


def _reset_impact() -> ResetImpact:
    late = VllmRoutingImpact(16, 4, 0, what="a vLLM engine reset while idle",
                             trials=[Trial(0, (40, 0), (0, 0)), Trial(1, (40, 0), (0, 16))])
    at_once = VllmRoutingImpact(16, 0, 0, what="a vLLM engine reset, published at once",
                                trials=[Trial(0, (21, 19), (0, 0)), Trial(1, (0, 40), (0, 16))])
    streams = {"late": [Served(0, 4, 0, 16), Served(0, 4, 64, 16)], "at_once": [Served(1, 1, 16, 16)]}
    return ResetImpact(late, at_once, streams)


def test_the_reset_report_has_its_control_table_and_its_bound_in_requests():
    impact = _reset_impact()
    assert list(tables(Cause.VLLM_RESET_PUBLISHED_LATE, impact)) == ["the reset queued",
                                                                     "control, the reset published at once"]
    assert [s.stale for s in impact.streams["late"]] == [True, False]
    assert "measured: 1 of 2 requests sent one at a time" in reset_bound(impact)
    assert "0 of 1 with the reset published at once" in reset_bound(impact)
    assert impact.says().startswith("changes the worker for 1 of 2 k (1)")
    assert "with the reset published at once (the control) it does not change the worker; " in impact.says()
