"""The servable property re-derived as SGLang's scheduler admits requests (issue 28).

A router block the engine never matches only because of the scheduler's prompt cap is
LAST_PAGE_CAPPED, counted apart; HOST_CREDIT_NOT_SERVABLE only where the host-only stretch lies
inside the capped prefix. Requests go through SGLang's own ``Req.init_next_round_input`` /
``PrefillAdder.add_one_req`` (:mod:`kvalign.oracles.admission`) and the real router path. The
negative control removes SGLang's cap (its ``Req._compute_max_prefix_len``) and shows that the
separation comes from SGLang's code: the old counterexample is a host-credit finding again.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvalign.oracles.admission import Admission
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.props.tier.servable import judge
from kvalign.verify.props.tier.servable_sequence import worked_case

HOST_CREDIT, CAPPED = "HOST_CREDIT_NOT_SERVABLE", "LAST_PAGE_CAPPED"


def _ask(hicache_router_path: Any, steps: list[tuple[Any, ...]], **kw: Any) -> list[dict[str, Any]]:
    from kvalign.verify.props.tier.servable_sequence import ask_servable

    return [v.judgement for v in ask_servable(steps, router_path=hicache_router_path, **kw)]


@pytest.mark.parametrize("core", ["unified", "unified-python"])
@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
def test_issue_case_is_host_credit_inside_the_capped_prefix(hicache_router_path, core, eagle):
    """2 pages on device, 2 host-only pages (8 slots) inside the 20 the scheduler matches: SGLang's
    _load_back_transfers declines (8 < 10), loads 0 back; the router credits the 2 host blocks."""
    from kvalign.oracles.hicache import available_cores

    if core not in available_cores():
        pytest.skip(f"this SGLang has no selectable {core} tree core")
    *_, last = _ask(hicache_router_path, worked_case(eagle), page_size=4, eagle=eagle, core=core)
    a = last["admission"]
    assert last["cause"] == HOST_CREDIT and (last["router_device"], last["router_host"]) == (2, 2), last["detail"]
    assert (a["prompt_tokens"], a["max_prefix_tokens"]) == (21 + eagle, 20 + eagle)
    assert (a["device_tokens"], a["host_only_tokens"], a["loaded_tokens"], a["cached_tokens"]) == (8, 8, 0, 8)
    assert a["prompt_tokens"] - 1 >= a["device_tokens"] + a["host_only_tokens"] and not last["last_page_capped"]


def old_steps(eagle: bool) -> list[tuple[Any, ...]]:
    """The counterexample kvalign published before issue 28 (page 2): a one-page prompt cached, evicted to
    host, asked for again."""
    prompt = [0, 0, 0] if eagle else [0, 0]
    return [("request", prompt), ("transfers_done",), ("evict_device", 128), ("request", prompt)]


@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
def test_old_counterexample_is_the_last_page_not_host_credit(hicache_router_path, eagle):
    """SGLang's scheduler matches at most input_len - 1 tokens: 0 pages of that prompt. The router's host
    block lies past the cap: LAST_PAGE_CAPPED, never HOST_CREDIT_NOT_SERVABLE."""
    *_, last = _ask(hicache_router_path, old_steps(eagle), page_size=2, eagle=eagle)
    a = last["admission"]
    assert last["router_host"] == 1 and a["host_only_tokens"] == 0 and a["device_tokens"] == 0
    assert last["cause"] is None and last["last_page_capped"] and last["capped_blocks"] == 1, last["detail"]


@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
def test_without_sglangs_cap_the_old_counterexample_is_host_credit_again(hicache_router_path, monkeypatch, eagle):
    """Negative control: SGLang's own Req._compute_max_prefix_len replaced by one that caps nothing. The
    scheduler then matches the whole prompt, the host page lies inside the match, and the old case is a
    host-credit finding again: the last page is kept apart by SGLang's code, not by kvalign's."""
    from sglang.srt.managers.schedule_batch import Req

    monkeypatch.setattr(Req, "_compute_max_prefix_len", lambda self, input_len: input_len)
    *_, last = _ask(hicache_router_path, old_steps(eagle), page_size=2, eagle=eagle)
    assert last["cause"] == HOST_CREDIT and not last["last_page_capped"], last["detail"]
    assert last["admission"]["max_prefix_tokens"] == last["admission"]["prompt_tokens"]


def _admission(prompt: int, device: int, host: int, loaded: int) -> Admission:
    return Admission(prompt, prompt - 1, device, host, loaded, device + loaded, True, "CONTINUE")


@pytest.mark.parametrize(("admission", "tiers", "cause", "capped"), [
    (_admission(8, 4, 0, 0), (2, 0), None, 1),  # the whole prompt cached at a page boundary: last page past the cap
    (_admission(8, 0, 4, 0), (0, 2), HOST_CREDIT, 1),  # one host page inside the cap, one past it
    (_admission(9, 0, 8, 8), (0, 2), None, 0),  # loaded back: served as credited
    (_admission(8, 4, 0, 0), (1, 1), None, 1),  # the only host block lies past the cap
    (_admission(21, 8, 8, 0), (2, 2), HOST_CREDIT, 0),  # issue 28's case
], ids=["device-last-page", "host-inside-and-past", "loaded", "host-past-cap-only", "issue-28"])
def test_judge_keeps_the_cap_apart_from_host_credit(admission, tiers, cause, capped):
    j = judge(admission, {"device_blocks": tiers[0], "host_pinned_extension_blocks": tiers[1]}, 4, eagle=False,
              threshold=10)
    assert (j.cause.name if j.cause else None, j.capped_blocks) == (cause, capped), j.detail


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
def test_host_credit_holds_under_every_write_policy(hicache_router_path, policy, eagle):
    """The scope the verdict line states (HiCache on, pages below 10) needs no write policy: a prompt hit twice
    (write_through_selective backs up on the second hit), evicted to host, then asked for with one token more."""
    prompt = list(range(1, 9 + eagle))
    steps = [("request", prompt), ("transfers_done",), ("request", prompt), ("transfers_done",), ("evict_device", 8),
             ("request", prompt + [9])]
    *_, last = _ask(hicache_router_path, steps, page_size=4, eagle=eagle, policy=policy)
    a = last["admission"]
    assert last["cause"] == HOST_CREDIT and (a["host_only_tokens"], a["loaded_tokens"]) == (8, 0), last["detail"]


def test_the_host_weight_said_is_the_router_s_configured_one_never_a_literal():
    """Issue 36: the detail once said "with host weight 0.75" whatever the router was configured with."""
    import types

    from kvalign.oracles.router_path import configured_host_weight

    a = Admission(prompt_tokens=5, max_prefix_tokens=4, device_tokens=0, host_only_tokens=4, loaded_tokens=0,
                  cached_tokens=0, admitted=True, result="CONTINUE")
    tiers = {"device_blocks": 0, "host_pinned_extension_blocks": 1}
    j = judge(a, tiers, 4, eagle=False, threshold=10, best_worker_overlap=1, host_weight=0.5)
    assert "(best_worker overlap 1, with host weight 0.5)" in j.detail and "0.75" not in j.detail
    with pytest.raises(ValueError, match="host_cache_hit_weight"):
        judge(a, tiers, 4, eagle=False, threshold=10, best_worker_overlap=1)
    # the weight is read from the binding's KvRouterConfig, the configuration the path's routers are built with
    config = types.SimpleNamespace(__text_signature__="(self, overlap_score_weight=None, host_cache_hit_weight=0.4)")
    assert configured_host_weight(types.SimpleNamespace(KvRouterConfig=config)) == 0.4
    with pytest.raises(OracleUnavailable, match="no host_cache_hit_weight"):
        configured_host_weight(types.SimpleNamespace(KvRouterConfig=types.SimpleNamespace(__text_signature__="(self)")))
