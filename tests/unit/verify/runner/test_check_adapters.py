"""Release adapters: an older binding's missing parameters become named findings, never crashes.

The "older bindings" here are the real 1.6.1 binding behind the exact signatures that ai-dynamo-runtime
1.0.x (no ``is_eagle``, no ``cache_namespace``) and 1.3.x (no ``cache_namespace``) export; the
CI matrix test runs a real 1.0.2 wheel as well (tests/unit/verify/report/test_matrix.py).
"""

from __future__ import annotations

import pytest

from kvalign.verify.runner.check import run_check, run_search
from kvalign.oracles.dynamo import adapt_hasher
from kvalign.verify.engine.properties import hash_property
from kvalign.verify.engine.strategies import hash_cases


@pytest.fixture
def binding_1_0(router_hasher):
    def compute_block_hash_for_seq(tokens, kv_block_size, block_mm_infos=None, lora_name=None):
        return router_hasher(tokens, kv_block_size, block_mm_infos, lora_name)

    return compute_block_hash_for_seq


@pytest.fixture
def binding_1_3(router_hasher):
    def compute_block_hash_for_seq(tokens, kv_block_size, block_mm_infos=None, lora_name=None, is_eagle=None):
        return router_hasher(tokens, kv_block_size, block_mm_infos, lora_name, is_eagle)

    return compute_block_hash_for_seq


def test_current_binding_is_not_wrapped(router_hasher):
    assert adapt_hasher(router_hasher) is router_hasher


def test_adapter_records_what_each_release_lacks(binding_1_0, binding_1_3):
    assert adapt_hasher(binding_1_0).missing == ("is_eagle", "cache_namespace")
    assert adapt_hasher(binding_1_3).missing == ("cache_namespace",)


@pytest.mark.parametrize(("eagle", "namespace", "cause"), [
    (True, False, "ROUTER_EAGLE_OFF"),
    (False, True, "NAMESPACE_DROPPED"),
    (False, False, None),
])
def test_binding_without_is_eagle_or_namespace_is_a_named_finding(binding_1_0, eagle, namespace, cause):
    hasher = adapt_hasher(binding_1_0)
    _, _, found = run_search(lambda case: hash_property(hasher, case),
                             hash_cases(eagle=eagle, lora=False, namespace=namespace, mm=False), 100)
    assert (found and found.cause.name) == cause


def test_check_rows_say_which_parameter_the_release_lacks(binding_1_3, cache_factory, dynamo_tree):
    rows = run_check(adapt_hasher(binding_1_3), cache_factory("unified"), dynamo_tree, examples=40,
                     props=("hash",), modes=("eagle",), variants=("base", "namespace"))
    base, ns = rows
    assert base.ok  # 1.3.x hashes EAGLE windows
    assert ns.cause_name == "NAMESPACE_DROPPED" and "has no cache_namespace parameter" in ns.detail
