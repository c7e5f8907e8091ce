"""The ``servable`` property held to the live engine: the cases the live HiCache runs met, asked again.

Each case is an ``offload`` step of ``kvalign e2e fuzz --hicache`` at page 4 (EAGLE3), its prompts
rebuilt from the step's JSON (:class:`kvalign.live.runs.fuzz.hicache_rules.OffloadPrompts`) in the
order the live worker received them, with the live worker's device pool (512 tokens) and host pool
(1028 tokens, ratio 2). :data:`LIVE` holds what the live engine and router reported for the last
request — recorded from the live runs (dynamo 1.6.1 x sglang 0.5.23 on the CPU engine, 2026-12-05:
the generated page-4 run's shrunk counterexample, and ``tests/e2e/fuzz_scripts/hicache-*.json``),
labelled as such, never computed here. The property must say the same: the scheduler's cap, the
residency, the load-back decision, the router's per-tier credit and the cause. Where they differ,
the live engine wins (docs/live-fuzz.md).
"""

from __future__ import annotations

import pytest

from kvalign.live.runs.fuzz.hicache_rules import OffloadPrompts

#: (the offload step, its pressure rounds live) -> what the live run reported for its re-query:
#: SGLang's split and residency (device, host-only, loaded tokens), the router's (device, host) blocks
#: from kv_hit_rate and its raw credit counter, and the fuzz's cause.
LIVE = {
    "page-4 run, shrunk": (({"seed": 1006, "base": 1, "ext": 1, "keep_base": False, "tail": 2}, 3),
                           (0, 8, 0), (0, 2), "HOST_CREDIT_NOT_SERVABLE"),
    "hicache-declined.json": (({"seed": 9, "base": 2, "ext": 2, "keep_base": True, "tail": 1}, 3),
                              (8, 8, 0), (2, 2), "HOST_CREDIT_NOT_SERVABLE"),
    "hicache-loaded.json": (({"seed": 7, "base": 2, "ext": 3, "keep_base": True, "tail": 1}, 3),
                            (8, 12, 12), (2, 3), None),
}
PAGE, DEVICE_TOKENS, HOST_TOKENS, PRESSURE_TOKENS = 4, 512, 1028, 170


def _steps(step: dict, rounds: int) -> list[tuple]:
    prompts = OffloadPrompts(step, PAGE, True, PRESSURE_TOKENS).sequence(rounds)
    out: list[tuple] = []
    for tokens in prompts:
        out += [("request", tokens), ("transfers_done",)]
    return out[:-1]


def _ask(step: dict, rounds: int, policy: str) -> dict:
    from kvalign.verify.props.tier.servable_sequence import ask_servable

    *_, last = ask_servable(_steps(step, rounds), page_size=PAGE, eagle=True, policy=policy,
                            device_tokens=DEVICE_TOKENS, host_tokens=HOST_TOKENS)
    return last.judgement


@pytest.mark.slow  # SGLang's scheduler code and a real KvRouter, about 10 s a case
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("case", list(LIVE))
def test_the_property_says_what_the_live_engine_did(case, policy):
    (step, rounds), split, router, cause = LIVE[case]
    j = _ask(step, rounds, policy)
    a = j["admission"]
    assert (a["device_tokens"], a["host_only_tokens"], a["loaded_tokens"]) == split, j
    assert (j["router_device"], j["router_host"]) == router, j
    assert j["cause"] == cause and not j["last_page_capped"], j
    assert a["prompt_tokens"] == len(OffloadPrompts(step, PAGE, True, PRESSURE_TOKENS).query)


@pytest.mark.slow
def test_negative_control_without_the_pressure_the_property_sees_no_host_stretch():
    """The same steps with no pressure round: nothing left the device, so nothing matches the live
    numbers — the comparison depends on the sequence, not on the case's name."""
    (step, _), split, router, _cause = LIVE["hicache-declined.json"]
    j = _ask(step, 0, "write_through")
    assert (j["admission"]["host_only_tokens"], j["router_host"]) == (0, 0) and j["cause"] is None
    assert (j["admission"]["device_tokens"], j["admission"]["host_only_tokens"], j["admission"]["loaded_tokens"]) != split
