"""The alignment properties on the real pair: SGLang's radix cache (CPU) x Dynamo's router.

Every cache class SGLang can serve with is covered: the server default ``UnifiedRadixCache``
(Rust tree core on 0.5.23), its Python core, and the plain ``RadixCache``.
"""

from __future__ import annotations

import pytest
from hypothesis import given

from kvalign.model.causes import Cause
from kvalign.verify.runner.check import run_search
from kvalign.verify.misaligned import drop_lora, drop_namespace, eagle_b_window, flip_eagle, ignore_eagle
from kvalign.oracles.sglang import KINDS
from kvalign.verify.engine.properties import Mismatch, overlap_property, pages_property
from kvalign.verify.engine.strategies import scenarios

MODES = {"plain": False, "eagle": True}
TENANTS = {"none": (False, False), "lora+namespace": (True, True)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tenants", TENANTS)
def test_engine_pages_hash_like_router_blocks(router_hasher, cache_factory, count_case, kind, mode, tenants):
    make = cache_factory(kind)
    lora, namespace = TENANTS[tenants]

    @given(sc=scenarios(eagle=MODES[mode], lora=lora, namespace=namespace))
    def prop(sc):
        count_case()
        pages_property(router_hasher, make, sc)

    prop()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tenants", TENANTS)
def test_sglang_reuse_equals_prediction_equals_router(router_hasher, dynamo_tree, cache_factory, count_case, kind, mode, tenants):
    make = cache_factory(kind)
    lora, namespace = TENANTS[tenants]

    @given(sc=scenarios(eagle=MODES[mode], lora=lora, namespace=namespace))
    def prop(sc):
        count_case()
        overlap_property(router_hasher, make, dynamo_tree, sc)

    prop()


# Each deliberately misaligned router must be caught by each property, in the mode where it is
# wrong, and the finding must carry the right name.
NEGATIVE = [
    (ignore_eagle, True, (False, False), {Cause.ROUTER_EAGLE_OFF}),
    (flip_eagle, True, (False, False), {Cause.ROUTER_EAGLE_OFF}),
    (flip_eagle, False, (False, False), {Cause.ROUTER_EAGLE_ON}),
    (eagle_b_window, True, (False, False), {Cause.EAGLE_B_WINDOW}),
    (drop_lora, False, (True, False), {Cause.LORA_DROPPED}),
    (drop_lora, True, (True, False), {Cause.LORA_DROPPED}),
    (drop_namespace, False, (False, True), {Cause.NAMESPACE_DROPPED}),
    (drop_namespace, True, (False, True), {Cause.NAMESPACE_DROPPED}),
]
IDS = [f"{h.__name__}-{'eagle' if e else 'plain'}" for h, e, _, _ in NEGATIVE]


@pytest.mark.parametrize(("hasher", "eagle", "tenants", "causes"), NEGATIVE, ids=IDS)
def test_negative_control_pages_property_detects_misaligned_router(cache_factory, hasher, eagle, tenants, causes):
    make = cache_factory("unified")
    _, failures, found = run_search(lambda sc: pages_property(hasher, make, sc), scenarios(eagle=eagle, lora=tenants[0], namespace=tenants[1]), 300)
    assert isinstance(found, Mismatch) and failures >= 1
    assert found.cause in causes, found


@pytest.mark.parametrize(("hasher", "eagle", "tenants", "causes"), NEGATIVE, ids=IDS)
def test_negative_control_overlap_property_detects_misaligned_router(cache_factory, dynamo_tree, hasher, eagle, tenants, causes):
    make = cache_factory("unified")
    _, failures, found = run_search(lambda sc: overlap_property(hasher, make, dynamo_tree, sc),
                                    scenarios(eagle=eagle, lora=tenants[0], namespace=tenants[1]), 300)
    assert isinstance(found, Mismatch) and failures >= 1, f"{hasher.__name__} not detected"
    assert found.cause in causes, found
