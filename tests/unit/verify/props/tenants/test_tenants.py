"""The ``tenants`` property in both of SGLang's KV-event formats, and its negative controls.

SGLang's real cache publishes (default format, or ``KVEventsConfig.format = "dynamo"``), its real
publisher sends, Dynamo's real relay and router ingest. The controls change SGLang's own event
objects the way a release with one field wrong would publish them (:mod:`kvalign.verify.props.tenants.controls`),
or run an engine that never loaded the adapters its requests name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvalign.model.causes import Cause
from router_paths import open_router_path
from kvalign.verify.props.tenants import controls as misaligned_events
from kvalign.verify.runner.check import run_search
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.props.tenants.body import TenantScenario, tenant_pool, tenant_scenarios, tenants_property

EXAMPLES = 6
FORMATS = ("default", "dynamo")
DOC = [0, 1, 2, 3, 0, 1, 2]  # three pages of 2 (the last token left over)


@pytest.fixture(scope="module")
def path(sglang_available) -> Iterator[Any]:
    from kvalign.oracles.sglang import has_dynamo_format

    if not has_dynamo_format():
        pytest.skip("this SGLang has no dynamo KV-event format")
    opened = open_router_path("real Dynamo router path unavailable")
    yield opened
    opened.close()


def _make(fmt: str):
    from kvalign.oracles.sglang import SglangRadixCache

    return lambda p, eagle: SglangRadixCache(p, eagle=eagle, dynamo_format=fmt == "dynamo")


def _cause(path: Any, fmt: str, sc: TenantScenario, mutate=None, **kw: Any) -> Cause | None:
    try:
        tenants_property(path, _make(fmt), sc, mutate, **kw)
    except Mismatch as found:
        return found.cause
    return None


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
def test_tenants_stay_apart_in_both_formats(path, count_case, fmt, eagle):
    """Generated tenants (LoRA and salt), branches, unnamed requests and a removal: the router follows."""
    calls, failures, found = run_search(lambda sc: tenants_property(path, _make(fmt), sc),
                                        tenant_scenarios(eagle=eagle, lora=True, namespace=True), EXAMPLES)
    for _ in range(calls):
        count_case()
    assert found is None, found
    assert calls == EXAMPLES and failures == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_request_without_its_lora_name_is_named_from_the_adapter_table(path, fmt):
    """SGLang's adapter-id fallback: a request that reaches the scheduler without its LoRA name, for an
    adapter SGLang loaded, is published with the adapter's name in both formats."""
    sc = TenantScenario(2, False, DOC, [(None, None), ("loraA", None), ("loraA", "tenant-1")], ("loraA",), None, True)
    assert _cause(path, fmt, sc) is None


def test_an_adapter_sglang_never_loaded_collides_only_in_the_default_format(path):
    """Two LoRA tenants whose names SGLang does not know: both formats publish no name (the root cause,
    named first); the default format also publishes their pages under one hash, so the router keeps one
    entry and a removal of one tenant's pages does not reach the other's; the dynamo format namespaces
    the hashes by extra_key."""
    sc = TenantScenario(2, False, DOC, [("loraA", None), ("loraB", None)], ("loraA", "loraB"), None, True)
    with pytest.raises(Mismatch) as found:
        tenants_property(path, _make("default"), sc, load_adapters=False)
    assert found.value.cause is Cause.LORA_NOT_IN_EVENTS and "also TENANT_HASH_COLLISION" in found.value.detail
    with pytest.raises(Mismatch) as found:
        tenants_property(path, _make("dynamo"), sc, load_adapters=False)
    assert found.value.cause is Cause.LORA_NOT_IN_EVENTS and "TENANT_HASH_COLLISION" not in found.value.detail
    # names restored, hashes untouched: the collision alone, in the default format only
    named = misaligned_events.restore_lora_name
    assert _cause(path, "default", sc, named, load_adapters=False) is Cause.TENANT_HASH_COLLISION
    assert _cause(path, "dynamo", sc, named, load_adapters=False) is None


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("control", "cause"), [
    ("strip_lora_name", Cause.LORA_NOT_IN_EVENTS),
    ("lora_id_as_name", Cause.LORA_NAME_MISMATCH),
])
def test_lora_name_controls(path, fmt, control, cause):
    sc = TenantScenario(2, False, DOC, [(None, None), ("loraA", None)], (), None, False)
    assert _cause(path, fmt, sc) is None
    assert _cause(path, fmt, sc, misaligned_events.ALL[control]) is cause


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_parent_in_another_namespace_is_named(path, fmt):
    """A branch page whose parent is the base model's page: the router attaches it below the wrong tenant."""
    sc = TenantScenario(2, False, DOC, [(None, None), ("loraA", None)], (), (1, 1, [5, 6, 5]), False)
    assert _cause(path, fmt, sc) is None
    assert _cause(path, fmt, sc, misaligned_events.parent_elsewhere) is Cause.PARENT_OUTSIDE_NAMESPACE


def test_scenarios_draw_distinct_tenants_sharing_one_prompt():
    from hypothesis import given, settings

    @settings(max_examples=30, database=None, derandomize=True)
    @given(tenant_scenarios(eagle=True, lora=True, namespace=False))
    def check(sc: TenantScenario) -> None:
        assert 2 <= len(sc.tenants) == len(set(sc.tenants)) and set(sc.tenants) <= set(tenant_pool(lora=True, namespace=False))
        assert set(sc.unnamed) <= {t[0] for t in sc.tenants if t[0]}
        assert (len(sc.doc) - 1) // sc.page_size >= 2
        if sc.branch is not None:
            i, pages, suffix = sc.branch
            assert sc.prompts(i)[1][: pages * sc.page_size + 1] == sc.doc[: pages * sc.page_size + 1]

    check()


def _strip_salt(frames: list[bytes]) -> list[bytes]:
    """A relay that ignores cache_salt (the frames of SGLang 0.5.23's map-form events): as the live fuzz's
    ``--strip-salt`` hop does, and ``tests/unit/oracles/test_router_path.py``'s control in the default format."""
    import msgpack

    batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
    for ev in batch[1]:
        if isinstance(ev, dict):
            ev.pop("cache_salt", None)
            ev.pop("metadata", None)
    return [frames[0], frames[1], msgpack.packb(batch, use_bin_type=True)]


def test_a_salt_blind_relay_is_tenants_share_keys_in_the_dynamo_format(sglang_available, router_hasher):
    """The cause the live run names for its salt-stripping hop in the dynamo format
    (docs/live-fuzz.md): ``ingest`` through a relay that drops cache_salt names TENANTS_SHARE_KEYS."""
    from kvalign.verify.engine.properties import ingest_property
    from kvalign.verify.engine.strategies import ingest_scenarios

    stripped = open_router_path("real Dynamo router path unavailable", _strip_salt)
    try:
        _calls, failures, found = run_search(lambda isc: ingest_property(stripped, router_hasher, _make("dynamo"), isc),
                                             ingest_scenarios(eagle=False, namespace=True), 15)
    finally:
        stripped.close()
    assert found is not None and failures > 0 and found.cause is Cause.TENANTS_SHARE_KEYS, found
