"""``card``: the ``enable_eagle`` the installed ``dynamo.sglang`` registration code puts on the model
card equals whether SGLang keys that speculative algorithm's cache by bigrams.

Exhaustive, not searched: every algorithm the installed SGLang defines, split by mode (``eagle`` =
the algorithms SGLang keys by bigrams). One job for both modes: the registration code loads once.
"""

from __future__ import annotations

import time
from typing import Any

from kvalign.model.causes import Cause
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.property import SetUpOnceProperty, unavailable
from kvalign.verify.engine.rows import RowResult


def name_set_note(missed: list[str], registered: int) -> str:
    """What an EAGLE card that is on for some bigram algorithms and off for others is: Dynamo #10982.

    Only a card derived from algorithm *names* can split the bigram algorithms (``registered`` of
    them get ``enable_eagle``, ``missed`` do not); a card without the field, or one stuck off, misses
    them all and is not this regression (the row stays CARD_EAGLE_OFF). For the split the row's cause
    is what a deployment sees, the router hashing those workers' queries with eagle off — the name
    ``diagnose`` and the live layer give the same bug — and the card's part is said in the detail.
    """
    return (f"Dynamo #10982 (fixed in 1.4.0): the card sets enable_eagle for {registered} bigram-keyed algorithm(s) "
            f"and not for {', '.join(missed)} (a hand-kept algorithm-name set, {Cause.CARD_EAGLE_OFF.name}), so the "
            "router hashes their workers' queries with eagle off: overlap 0 on every bigram page")


def run_card(systems: Any, modes: tuple[str, ...]) -> list[RowResult]:
    """One row per mode: every algorithm of that mode through the real registration code."""
    from kvalign.oracles.registration import sglang_keys_bigrams, speculative_algorithms
    from kvalign.verify.engine.properties import Mismatch, card_property

    try:
        reg = systems.registration()
    except OracleUnavailable as exc:
        return unavailable("card", modes, ("base",), str(exc), Cause.CARD_UNAVAILABLE)
    rows = []
    algorithms = speculative_algorithms()
    for mode in modes:
        start = time.perf_counter()
        row = RowResult("card", mode, "base")
        missed: list[str] = []
        for alg in (a for a in algorithms if sglang_keys_bigrams(a) == (mode == "eagle")):
            row.cases += 1
            try:
                card_property(reg.derive, sglang_keys_bigrams, alg)
            except Mismatch as found:
                row.mismatches += 1
                if found.cause is Cause.CARD_EAGLE_OFF and alg is not None:
                    missed.append(alg)
                if row.cause is None:
                    row.cause, row.cause_name, row.detail, row.counterexample = (
                        found.cause.value, found.cause.name, f"{found.detail} [{reg.function}]", alg)
            except Exception as exc:  # the release's own code failed on a worker's arguments
                row.mismatches += 1
                if row.cause is None:
                    row.cause, row.cause_name = Cause.CARD_UNAVAILABLE.value, Cause.CARD_UNAVAILABLE.name
                    row.detail, row.counterexample = f"{reg.function}({alg!r}) raised {type(exc).__name__}: {exc}", alg
        if missed and row.cases > row.mismatches:  # some bigram algorithms registered, these not: #10982
            row.cause, row.cause_name = Cause.ROUTER_EAGLE_OFF.value, Cause.ROUTER_EAGLE_OFF.name
            row.detail = f"{name_set_note(missed, row.cases - row.mismatches)}; {row.detail}"
        row.seconds = time.perf_counter() - start
        rows.append(row)
    return rows


PROPERTY = SetUpOnceProperty("card", rows=lambda systems, modes, _opts: run_card(systems, modes), events="none",
                             cost=1.5, shares="registration")
