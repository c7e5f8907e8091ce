"""The ``hybrid`` property against the real systems, and its negative control.

SGLang's real ``UnifiedRadixCache`` with an SWA or Mamba component
(:class:`~kvalign.oracles.hybrid.HybridCache`), SGLang's real publisher, Dynamo's real relay and a
real ``KvRouter``. On the pinned pair the property finds the hybrid credit skew; a run without
state-only evictions and without mid-node cuts agrees; the negative control (SGLang's removals
dropped before the relay) must be reported as ``INGEST_STALE``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvalign.model.causes import Cause

EXAMPLES = 6


@pytest.fixture(scope="module")
def path(sglang_available: str) -> Iterator[Any]:
    from router_paths import open_router_path

    opened = open_router_path("Dynamo's relay / router cannot start here")
    yield opened
    opened.close()


def _search(body: Any, component: str, eagle: bool, n: int = EXAMPLES, sizes: tuple[int, ...] | None = None) -> Any:
    from kvalign.verify.props.hybrid.body import hybrid_scenarios
    from kvalign.verify.engine.search import run_search

    return run_search(body, hybrid_scenarios(component, eagle, sizes), n)


def test_judge_classes() -> None:
    """Each way the router's credit can sit against SGLang's full-attention and reusable prefixes."""
    from kvalign.verify.props.hybrid.body import judge

    assert judge("swa", False, False, 2, 2, 4, 4, [0]) is None
    assert judge("swa", False, False, 2, 2, 0, 4, [0])[:1] == (Cause.SWA_STATE_NOT_REUSABLE,)
    assert judge("mamba", False, False, 1, 3, 1, 3, [0])[::2] == (Cause.MAMBA_STATE_NOT_REUSABLE, 2)
    assert judge("swa", False, False, 2, 3, 2, 4, [0])[0] is Cause.INGEST_STALE
    assert judge("swa", False, False, 2, 1, 4, 4, [0])[0] is Cause.EVENTS_DROPPED
    assert judge("mamba", True, False, 1, 0, 4, 4, [0])[0] is Cause.ROUTER_EAGLE_ON


#: The shrunk counterexamples ``check --property hybrid`` reports on the pinned pair (one per component).
SKEWED = {
    "swa": ("swa", 2, False, 2, "rust", [("insert", [0, 0, 0, 0]), ("evict_state", 1)]),
    "mamba": ("mamba", 1, False, 4, "rust", [("insert", [0]), ("insert", [0, 0, 0])]),
}


@pytest.mark.parametrize("component", ["swa", "mamba"])
def test_hybrid_finds_the_credit_skew(path: Any, component: str) -> None:
    from kvalign.verify.props.hybrid.body import HybridRun, Scenario
    from kvalign.verify.engine.properties import Mismatch

    body = HybridRun(path, component, False)
    with pytest.raises(Mismatch) as found:
        body(Scenario(*SKEWED[component]))
    assert found.value.cause is (Cause.SWA_STATE_NOT_REUSABLE if component == "swa" else Cause.MAMBA_STATE_NOT_REUSABLE)
    assert found.value.condition and "hybrid" in found.value.condition
    assert body.bound == 1 and body.skewed == 1


def test_a_request_decoded_past_its_window_is_the_swa_finding(path: Any) -> None:
    """SGLang's production SWA path (issue 43), drawn by the search as ``decode_insert``: a 16-token request
    whose window slots behind its 2-token window SGLang freed while it decoded, then cached. Every page is
    published as stored; a cut behind the window is credited and not reusable. The same request cached whole
    (``insert``) agrees: the finding comes from the mid-request free."""
    from kvalign.verify.props.hybrid.body import HybridRun, Scenario, hybrid_scenarios
    from kvalign.verify.engine.properties import Mismatch

    tokens = [0, 1, 2, 3] * 4
    body = HybridRun(path, "swa", False)
    with pytest.raises(Mismatch) as found:
        body(Scenario("swa", 2, False, 2, "rust", [("decode_insert", tokens)]))
    assert found.value.cause is Cause.SWA_STATE_NOT_REUSABLE and body.bound >= 5, found.value.detail
    HybridRun(path, "swa", False)(Scenario("swa", 2, False, 2, "rust", [("insert", tokens)]))
    # one strategy per component: .example() generates a batch of 10 per call on a fresh strategy and keeps
    # the rest for the next call on the same one (60 fresh strategies were 600 scenarios, 1.5 CPU-s, for 60)
    swa, mamba = hybrid_scenarios("swa", False), hybrid_scenarios("mamba", False)
    kinds = {s[0] for _ in range(30) for s in swa.example().steps}
    assert "decode_insert" in kinds and "decode_insert" not in {s[0] for _ in range(30) for s in mamba.example().steps}


@pytest.mark.slow  # fast tier: the negative controls and the fixed counterexamples
def test_hybrid_search_finds_the_mamba_skew(path: Any) -> None:
    from kvalign.verify.props.hybrid.body import HybridRun

    _calls, failures, found = _search(HybridRun(path, "mamba", False), "mamba", False)
    assert found is not None and failures and found.cause is Cause.MAMBA_STATE_NOT_REUSABLE


def test_hybrid_agrees_without_state_loss(path: Any) -> None:
    """Inserts and full evictions of whole prompts on an SWA tree: the router credits what SGLang reuses."""
    from kvalign.verify.props.hybrid.body import HybridRun, Scenario

    sc = Scenario("swa", 4, False, 4, "python", [("insert", [0, 1, 2, 3, 0, 1, 2, 3]), ("insert", [3, 3, 3, 3]),
                                                   ("evict", 4)])
    HybridRun(path, "swa", False)(sc)  # raises Mismatch on any disagreement


#: Per component, a scenario in which SGLang never loses hybrid state: the reusable prefix is the full one throughout.
WHOLE = {
    "swa": ("swa", 4, False, 4, "python", [("insert", [0, 1, 2, 3, 0, 1, 2, 3]), ("insert", [3, 3, 3, 3]), ("evict", 4)]),
    "mamba": ("mamba", 1, False, 4, "rust", [("insert", [0]), ("evict", 1)]),
}


def test_a_row_that_never_lost_state_is_na_not_ok(path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No example left SGLang's reusable prefix short of its full-attention one (no window KV or Mamba state
    evicted or missing): the row checked only what ``ingest`` checks, so it is ``n/a`` saying so, not ``ok``
    (issue 43). Its negative control still runs and fails as it must."""
    from types import SimpleNamespace

    from hypothesis import strategies as st

    import kvalign.verify.props.hybrid.body as hybrid

    monkeypatch.setattr(hybrid, "hybrid_scenarios",
                        lambda component, eagle, sizes=None: st.just(hybrid.Scenario(*WHOLE[component])))
    rows = hybrid.run_hybrid_rows(SimpleNamespace(router_path=lambda: path), ("plain",), 2)
    assert [(r.variant, r.status, r.cases, r.mismatches) for r in rows] == [("swa", "n/a", 1, 0), ("mamba", "n/a", 1, 0)], \
        [(r.variant, r.status, r.detail) for r in rows]
    for row in rows:
        assert row.skipped and "short of" in row.skipped, row.skipped
        assert row.control and row.control["failed"], row.control


def test_mamba_eagle_is_cache_blind(path: Any) -> None:
    """An EAGLE worker's card against a Mamba tree SGLang keys in plain tokens."""
    from kvalign.verify.props.hybrid.body import HybridRun

    _calls, _failures, found = _search(HybridRun(path, "mamba", True), "mamba", True, n=3)
    assert found is not None and found.cause is Cause.ROUTER_EAGLE_ON


#: A prompt cached, then evicted in full: SGLang publishes its removal, which the control drops.
EVICTED = {
    ("swa", False): ("swa", 2, False, 2, "rust", [("insert", [0, 1, 2, 3]), ("evict", 4)]),
    ("mamba", False): ("mamba", 1, False, 4, "rust", [("insert", [0, 1, 2]), ("evict", 3)]),
    ("mamba", True): ("mamba", 1, True, 4, "rust", [("insert", [0, 1, 2]), ("evict", 3)]),
}


@pytest.mark.parametrize("component,eagle", list(EVICTED))
def test_negative_control_dropped_removals(path: Any, component: str, eagle: bool) -> None:
    from kvalign.verify.props.hybrid.body import HybridRun, Scenario, drop_removals
    from kvalign.verify.engine.properties import Mismatch

    HybridRun(path, component, eagle, tolerate_skew=True, card_as_keys=True)(Scenario(*EVICTED[component, eagle]))
    body = HybridRun(path, component, eagle, mutate=drop_removals, tolerate_skew=True, card_as_keys=True)
    with pytest.raises(Mismatch) as found:
        body(Scenario(*EVICTED[component, eagle]))
    assert found.value.cause is Cause.INGEST_STALE


@pytest.mark.slow  # the generated control search, as check runs it beside every row
@pytest.mark.parametrize("component,eagle", list(EVICTED))
def test_negative_control_search(path: Any, component: str, eagle: bool) -> None:
    """The control search exactly as ``check`` runs it beside the row (not shrunk: the row keeps only its cause)."""
    from kvalign.verify.props.hybrid.body import control_search

    _calls, found = control_search(path, component, eagle)
    assert found is not None and found.cause is Cause.INGEST_STALE and not found.unconfirmed, found


@pytest.mark.slow  # fast tier: the negative controls and the fixed counterexamples
def test_without_the_mutation_the_control_run_is_clean(path: Any) -> None:
    """The control's body with nothing dropped passes (only the skew, tolerated, would fail it)."""
    from kvalign.verify.props.hybrid.body import HybridRun

    body = HybridRun(path, "mamba", False, tolerate_skew=True, card_as_keys=True)
    _calls, _failures, found = _search(body, "mamba", False, n=10)
    assert found is None
