"""The ``card`` property: dynamo.sglang's real registration code vs SGLang's bigram rule, per algorithm.

Negative controls patch the *registration function* the real code calls (the hand-kept name set of
Dynamo <= 1.4, a flag stuck on) and check the property names the card-side cause.
"""

from __future__ import annotations

import pytest

from kvalign.model.causes import Cause
from kvalign.verify.props.card import run_card
from kvalign.verify.engine.systems import Systems
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.properties import Mismatch, card_property


@pytest.fixture(scope="module")
def registration():
    from kvalign.oracles.registration import load_registration

    try:
        return load_registration()
    except OracleUnavailable as exc:
        pytest.skip(f"dynamo.sglang registration code unavailable: {exc}")


def _systems(registration) -> Systems:
    return Systems(hasher=None, make_cache=None, make_index=None, load_registration=lambda: registration)  # type: ignore[arg-type]


def test_every_algorithm_registers_the_card_sglang_needs(registration):
    from kvalign.oracles.registration import sglang_keys_bigrams, speculative_algorithms

    algorithms = speculative_algorithms()
    assert {"EAGLE", "EAGLE3", "FROZEN_KV_MTP", "NGRAM"} <= set(algorithms) and None in algorithms
    assert {a for a in algorithms if sglang_keys_bigrams(a)} == {"EAGLE", "EAGLE3", "FROZEN_KV_MTP"}
    rows = run_card(_systems(registration), ("plain", "eagle"))
    assert [(r.mode, r.ok) for r in rows] == [("plain", True), ("eagle", True)]
    assert rows[1].cases == 3 and rows[0].cases == len(algorithms) - 3


def test_card_table_equals_the_recorded_one_while_its_key_holds(registration):
    """The recorded card table (scripts/record_references.py) against the real registration code: equal
    while the key (Dynamo, SGLang, Triton, registration sources) holds; a changed key is said, not hidden."""
    import warnings

    import recorded

    key = recorded.card_key()
    doc = recorded.load("card", f"{key['dynamo']}-{key['sglang']}")
    why = recorded.stale_reason(doc, key, f" of the card table for ai-dynamo {key['dynamo']} x sglang {key['sglang']}")
    if why:
        warnings.warn(recorded.StaleReference(why))
        pytest.skip(why)
    table = recorded.card_table(registration)
    assert table == doc["table"], "the registration code's cards changed under the same key"
    assert {a for a, row in table.items() if row["sglang_keys_bigrams"]} == {"EAGLE", "EAGLE3", "FROZEN_KV_MTP"}
    assert all(row["enable_eagle"] == row["sglang_keys_bigrams"] for row in table.values())


def test_hand_kept_name_set_is_caught_as_the_router_hashing_eagle_off(registration, monkeypatch):
    """Dynamo #10982: enable_eagle from ("EAGLE", "NEXTN") misses EAGLE3 and FROZEN_KV_MTP, so the
    router hashes those workers' queries with eagle off: the row names that, and the card in its detail."""
    import dynamo.sglang.register as register

    monkeypatch.setattr(register, "_eagle_enabled_for", lambda alg: alg in ("EAGLE", "NEXTN"))
    plain, eagle = run_card(_systems(registration), ("plain", "eagle"))
    assert plain.ok
    assert not eagle.ok and eagle.mismatches == 2 and eagle.cause_name == "ROUTER_EAGLE_OFF"
    assert eagle.counterexample == "EAGLE3" and "--speculative-algorithm EAGLE3" in eagle.detail
    assert "enable_eagle=False" in eagle.detail and registration.function in eagle.detail
    # a card on for EAGLE and off for EAGLE3 is named as the regression, the card's part in the detail
    assert "Dynamo #10982" in eagle.detail and "not for EAGLE3, FROZEN_KV_MTP" in eagle.detail
    assert "CARD_EAGLE_OFF" in eagle.detail
    # cache-blind: it fails `check` (exit 1) whatever --strict says
    from kvalign.verify.engine.impact import blocking, row_class

    assert row_class(eagle) == "cache-blind" and blocking([plain, eagle]) == [eagle]


def test_a_card_off_for_every_bigram_algorithm_is_not_named_10982(registration, monkeypatch):
    """The #10982 note needs a *split*: a card stuck off misses EAGLE too, which is another bug."""
    import dynamo.sglang.register as register

    monkeypatch.setattr(register, "_eagle_enabled_for", lambda alg: False)
    _plain, eagle = run_card(_systems(registration), ("plain", "eagle"))
    assert eagle.cause_name == "CARD_EAGLE_OFF" and eagle.mismatches == 3 and "#10982" not in eagle.detail


def test_flag_stuck_on_is_caught_as_card_eagle_on(registration, monkeypatch):
    import dynamo.sglang.register as register

    monkeypatch.setattr(register, "_eagle_enabled_for", lambda alg: True)
    plain, eagle = run_card(_systems(registration), ("plain", "eagle"))
    assert eagle.ok and not plain.ok and plain.cause_name == "CARD_EAGLE_ON"


def test_registration_that_raises_is_a_finding_not_a_crash(registration, monkeypatch):
    import dynamo.sglang.register as register

    def broken(alg):
        raise KeyError("speculative_num_steps")

    monkeypatch.setattr(register, "_eagle_enabled_for", broken)
    rows = run_card(_systems(registration), ("plain", "eagle"))
    assert all(r.cause_name == "CARD_UNAVAILABLE" and "KeyError" in r.detail for r in rows)


def test_registration_that_cannot_load_is_a_finding():
    def unavailable():
        raise OracleUnavailable("dynamo.sglang.register does not import here (ImportError: x)")

    rows = run_card(Systems(None, None, None, load_registration=unavailable), ("plain", "eagle"))  # type: ignore[arg-type]
    assert [r.cause_name for r in rows] == ["CARD_UNAVAILABLE", "CARD_UNAVAILABLE"] and "ImportError" in rows[0].detail


def test_card_without_enable_eagle_field_says_so():
    with pytest.raises(Mismatch) as err:
        card_property(lambda alg: None, lambda alg: alg == "EAGLE3", "EAGLE3")
    assert err.value.cause is Cause.CARD_EAGLE_OFF and "no enable_eagle field" in err.value.detail
    card_property(lambda alg: None, lambda alg: False, "NGRAM")  # no field, plain algorithm: aligned
