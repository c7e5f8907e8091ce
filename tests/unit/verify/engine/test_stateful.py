"""Stateful differential test: insert / match / evict on the real SGLang cache, its events fed to
kvalign's index and to Dynamo's real RadixTree; after every step all three agree on overlap."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from kvalign.model.causes import Cause
from kvalign.verify.misaligned import drop_namespace, ignore_eagle
from kvalign.oracles.sglang import KINDS
from kvalign.verify.engine.properties import AlignmentHarness, Mismatch
from kvalign.verify.engine.strategies import PAGE_SIZES, tenants, token_ids

TOKENS = token_ids(max_size=40, vocab=3)
TENANTS = tenants(lora=True, namespace=True)


def machine(hasher, make_cache_for_kind, make_index, count_case, *, eagle=None):
    """A state machine class bound to the systems under test (hasher may be misaligned)."""

    class Alignment(RuleBasedStateMachine):
        harness: AlignmentHarness | None = None

        @initialize(kind=st.sampled_from(KINDS), page_size=st.sampled_from(PAGE_SIZES),
                    eagle=st.booleans() if eagle is None else st.just(eagle))
        def start(self, kind, page_size, eagle):
            self.harness = AlignmentHarness(hasher, make_cache_for_kind(kind), make_index, page_size, eagle)

        @precondition(lambda self: self.harness is not None)
        @rule(tokens=TOKENS, tenant=TENANTS)
        def insert(self, tokens, tenant):
            self.harness.insert(tokens, tenant)

        @precondition(lambda self: self.harness is not None)
        @rule(num_tokens=st.integers(1, 48))
        def evict(self, num_tokens):
            self.harness.evict(num_tokens)

        @precondition(lambda self: self.harness is not None and self.harness.requests)
        @rule(data=st.data())
        def query_shared_prefix(self, data):
            count_case()
            tokens, tenant = data.draw(st.sampled_from(self.harness.requests))
            cut = data.draw(st.integers(0, len(tokens)))
            query = tokens[:cut] + data.draw(TOKENS)
            self.harness.check_query(query, data.draw(st.one_of(st.just(tenant), TENANTS)), (query, tenant))

        @precondition(lambda self: self.harness is not None)
        @rule(query=TOKENS, tenant=TENANTS)
        def query_any(self, query, tenant):
            count_case()
            self.harness.check_query(query, tenant, (query, tenant))

    return Alignment


def test_sglang_kvalign_and_dynamo_agree_after_every_step(router_hasher, cache_factory, dynamo_tree, count_case):
    """500 runs of 30 steps (the nightly 2,000), 200 in the fast tier: a query costs a few milliseconds
    against three real systems, so this is the cheapest differential check per case; at 500 it was the
    fast tier's longest test (about 18 s of CPU), and the fast tier's budget is 60 s."""
    Machine = machine(router_hasher, cache_factory, dynamo_tree, count_case)
    runs = max(min(500, 10 * settings.default.max_examples), 2 * settings.default.max_examples)
    run_state_machine_as_test(Machine, settings=settings(settings.default, stateful_step_count=30, max_examples=runs))


@pytest.mark.parametrize(("hasher", "eagle", "cause"), [(ignore_eagle, True, Cause.ROUTER_EAGLE_OFF), (drop_namespace, None, Cause.NAMESPACE_DROPPED)])
def test_negative_control_stateful_detects_misaligned_router(cache_factory, dynamo_tree, hasher, eagle, cause):
    Machine = machine(hasher, cache_factory, dynamo_tree, lambda: None, eagle=eagle)
    with pytest.raises(Mismatch) as found:  # detection and its name are the point here: skip shrinking
        run_state_machine_as_test(Machine, settings=settings(settings.default, max_examples=300, stateful_step_count=30,
                                                             derandomize=True, database=None, report_multiple_bugs=False,
                                                             phases=(Phase.generate,)))
    assert found.value.cause is cause
