"""The ``storage`` property against the real systems, and its negative controls.

SGLang's real HiCache controller with the ``file`` backend (:class:`~kvalign.oracles.storage.StorageEngine`),
SGLang's real publisher, Dynamo's real relay and a real ``KvRouter``. Tier rows: the under-credit of
pages refilled from storage is found, and dropping the refill's host stores must fail the tier check.
Tenant rows: a second tenant reuses nothing, and a tenant B sent with tenant A's namespace on purpose
must be reported as a cross-tenant leak.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvalign.model.causes import Cause

#: 6 pages of 2 (12 tokens): SGLang loads the refilled stretch back (its load_back_threshold is 10 tokens)
SCENARIO = dict(page_size=2, eagle=False, prompts=[[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0]], host_evict=None)
#: 2 pages of 2 (4 tokens): refilled, then declined by SGLang's scheduler and re-prefilled
SHORT = dict(page_size=2, eagle=False, prompts=[[0, 1, 2, 3, 0]], host_evict=None)


@pytest.fixture(scope="module")
def path(sglang_available: str) -> Iterator[Any]:
    from router_paths import open_router_path

    from kvalign.verify.props.tier.body import TierPath

    tiers = TierPath(open_router_path("Dynamo's relay / router cannot start here"))
    yield tiers
    tiers.close()
    tiers.path.close()


def _scenario(spec: dict[str, Any] = SCENARIO) -> Any:
    from kvalign.verify.props.storage.body import StorageScenario

    return StorageScenario(**spec)


def test_refilled_pages_are_credited_in_no_tier(path: Any) -> None:
    from kvalign.verify.props.storage.body import StorageRun

    body = StorageRun(path, False, "base")
    body(_scenario())  # the refill's events reach the router's host tier: nothing raised
    assert body.finding is not None and body.finding.cause is Cause.STORAGE_TIER_UNCREDITED
    assert body.bound == 6 and body.refilled_examples == 1 and body.declined == 0
    admitted = body.finding.example["admission"]
    assert admitted["loaded_tokens"] == admitted["cached_tokens"] == 12, admitted  # SGLang's scheduler reused them


def test_a_refill_sglang_declines_to_load_back_is_not_a_finding(path: Any) -> None:
    """4 refilled tokens, below SGLang's load_back_threshold: its scheduler re-prefills them, so the router's
    0 credit lost nothing (the published counterexample must obey the engine's own threshold)."""
    from kvalign.verify.props.storage.body import StorageRun

    body = StorageRun(path, False, "base")
    body(_scenario(SHORT))
    assert body.refilled_examples == 1 and body.declined == 1
    assert body.finding is None and body.uncredited == 0


def test_negative_control_refill_events_dropped(path: Any) -> None:
    from kvalign.verify.engine.properties import Mismatch
    from kvalign.verify.props.storage.body import TIER_CAUSES, StorageRun, drop_host_stores

    with pytest.raises(Mismatch) as found:
        StorageRun(path, False, "base", mutate=drop_host_stores)(_scenario())
    assert found.value.cause in TIER_CAUSES


def test_a_row_no_refill_was_loaded_back_in_is_na_not_ok(path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every example's refill declined by SGLang's scheduler (below its load_back_threshold): the row never
    exercised what it checks, storage pages reused without the router's credit, so it is ``n/a`` saying so,
    not ``ok`` (issue 43). Its negative control still runs and fails as it must."""
    from types import SimpleNamespace

    from hypothesis import strategies as st

    import kvalign.verify.props.storage.body as storage

    monkeypatch.setattr(storage, "storage_scenarios", lambda eagle, sizes=None: st.just(_scenario(SHORT)))
    [row] = storage.run_storage_rows(SimpleNamespace(router_path=lambda: path.path), ("plain",), ("base",), 2)
    assert (row.status, row.cases, row.mismatches) == ("n/a", 1, 0), (row.status, row.detail)
    assert row.skipped and "loaded back" in row.skipped and "1 declined" in row.skipped, row.skipped
    assert row.control and row.control["failed"], row.control


@pytest.mark.parametrize("variant", ["lora", "namespace", "lora+namespace"])
def test_second_tenant_reuses_nothing(path: Any, variant: str) -> None:
    from kvalign.verify.props.storage.body import StorageRun

    body = StorageRun(path, False, variant)
    body(_scenario())
    assert body.refilled_examples == 1  # tenant A's own pages did come back from storage


@pytest.mark.parametrize("variant", ["lora", "namespace"])
def test_negative_control_shared_namespace(path: Any, variant: str) -> None:
    from kvalign.verify.engine.properties import Mismatch
    from kvalign.verify.props.storage.body import StorageRun

    with pytest.raises(Mismatch) as found:
        StorageRun(path, False, variant, shared_namespace=True)(_scenario())
    assert found.value.cause is Cause.TENANT_STORAGE_REUSE
    # the leak is through storage: tenant A's 6 pages, gone from device and host, refilled for B
    assert "0 device + 0 host + 6 storage page(s) for B, refilled 6 page(s) of A's from storage for B" \
        in found.value.detail, found.value.detail


@pytest.mark.slow  # fast tier: the negative controls and the fixed counterexamples
def test_generated_tenant_row_and_its_control(path: Any) -> None:
    from kvalign.verify.engine.search import run_search
    from kvalign.verify.props.storage.body import StorageRun, storage_scenarios

    calls, failures, found = run_search(StorageRun(path, True, "lora+namespace"), storage_scenarios(True), 4)
    assert calls == 4 and failures == 0 and found is None
    _c, _f, found = run_search(StorageRun(path, True, "lora+namespace", shared_namespace=True), storage_scenarios(True), 4)
    assert found is not None and found.cause is Cause.TENANT_STORAGE_REUSE


@pytest.mark.slow  # a fresh router path and a search: the report's own path
def test_report_finds_the_storage_finding(sglang_available: str) -> None:
    from kvalign.verify.report.finding import collect

    data = collect(Cause.STORAGE_TIER_UNCREDITED, ("plain",), 4)
    assert (data["property"], data["variant"]) == ("storage", "base")
    assert all(a.get("line") for a in data["anchors"])  # every source anchor is found in the installed release
