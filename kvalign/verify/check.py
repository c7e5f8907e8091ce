"""``kvalign check``'s engine: run the alignment properties as Hypothesis searches, outside pytest.

A CI job or an engineer with a patched router wants one answer — aligned or not — plus, for a
failure, the smallest input that shows it and a named cause. Hypothesis gives the search and the
shrinking; this module runs each property x mode x variant, counts cases, and keeps the shrunk
counterexample (the last exception Hypothesis raises is the one from the minimal example).

``card`` is exhaustive instead (every speculative algorithm the installed SGLang defines, split by
mode: ``eagle`` = the algorithms SGLang keys by bigrams). ``ingest`` runs the real worker relay and
router, so it gets its own, smaller example budget. A piece of the path that cannot run for this
release pair (registration code that does not import with this SGLang, a relay that cannot start)
is a row with a cause, not a crash: that is what a deployment of the pair would hit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

from hypothesis import strategies as st

from kvalign.model.causes import Cause
from kvalign.oracles.base import OracleUnavailable, RouterHasher
from kvalign.verify.rows import DEFAULT_FORMAT_PROPERTIES, DEFAULT_PROPERTIES, EVENT_PROPERTIES, MODES, VARIANTS, RowResult
from kvalign.verify.properties import Mismatch, card_property, hash_property, ingest_property, overlap_property, pages_property
from kvalign.verify.search import run_search  # noqa: F401 - re-exported: check's engine, as before
from kvalign.verify.strategies import hash_cases, ingest_scenarios, scenarios


@dataclass
class Systems:
    """The real systems ``check`` drives. ``registration`` and ``router_path`` are loaded lazily (and
    only once) because each costs seconds and only ``card`` / ``ingest`` need them."""

    hasher: RouterHasher
    make_cache: Callable[[int, bool], Any]
    make_index: Callable[[], Any]
    load_registration: Callable[[], Any] | None = None
    open_router_path: Callable[[], Any] | None = None
    _registration: Any = None
    _path: Any = None

    def registration(self) -> Any:
        if self._registration is None:
            if self.load_registration is None:
                from kvalign.oracles.registration import load_registration

                self.load_registration = load_registration
            self._registration = self.load_registration()
        return self._registration

    def router_path(self) -> Any:
        if self._path is None:
            if self.open_router_path is None:
                from kvalign.oracles.router_path import RouterPath

                self.open_router_path = RouterPath
            self._path = self.open_router_path()
        return self._path

    def close(self) -> None:
        if self._path is not None:
            self._path.close()
            self._path = None


def property_body(prop: str, hasher: RouterHasher, make_cache: Callable[[int, bool], Any], make_index: Callable[[], Any],
                  systems: Systems | None = None) -> Callable[[Any], None]:
    """The per-example function for one property, bound to the systems under test."""
    if prop == "ingest":
        assert systems is not None
        path = systems.router_path()
        return lambda isc: ingest_property(path, hasher, make_cache, isc)
    if prop == "tenants":
        from kvalign.verify.tenants import tenants_property

        assert systems is not None
        tenant_path = systems.router_path()
        return lambda sc: tenants_property(tenant_path, make_cache, sc)
    if prop == "hash":
        return lambda case: hash_property(hasher, case)
    if prop == "pages":
        return lambda sc: pages_property(hasher, make_cache, sc)
    if prop == "overlap":
        return lambda sc: overlap_property(hasher, make_cache, make_index, sc)
    raise ValueError(f"unknown property {prop!r}")


def strategy_for(prop: str, mode: str, variant: str, page_size: int | None = None) -> st.SearchStrategy[Any]:
    """The generated inputs of one row; ``page_size`` pins the page / block size (``check --page-size``),
    None draws every size the property's strategy draws."""
    lora, namespace = VARIANTS[variant]
    eagle = mode == "eagle"
    if prop == "tenants":
        from kvalign.verify.tenants import tenant_scenarios

        if page_size:
            return tenant_scenarios(eagle=eagle, lora=lora, namespace=namespace, page_sizes=(page_size,))
        return tenant_scenarios(eagle=eagle, lora=lora, namespace=namespace)
    if prop == "ingest":
        if page_size:
            return ingest_scenarios(eagle=eagle, lora=lora, namespace=namespace, page_sizes=(page_size,))
        return ingest_scenarios(eagle=eagle, lora=lora, namespace=namespace)
    if prop == "hash":
        return hash_cases(eagle=eagle, lora=lora, namespace=namespace, mm=variant == "base", block_size=page_size)
    if page_size:
        return scenarios(eagle=eagle, lora=lora, namespace=namespace, page_sizes=(page_size,))
    return scenarios(eagle=eagle, lora=lora, namespace=namespace)


def _plain(value: Any) -> Any:
    return asdict(value) if is_dataclass(value) else value


def _capability_note(hasher: RouterHasher, row: RowResult) -> None:
    missing = getattr(hasher, "missing", ())
    if missing and row.detail and row.prop in ("hash", "pages", "overlap"):
        row.detail += f" [this release's compute_block_hash_for_seq has no {' / '.join(missing)} parameter]"


def run_card(systems: Systems, modes: tuple[str, ...]) -> list[RowResult]:
    """One row per mode: every algorithm of that mode through the real registration code."""
    from kvalign.oracles.registration import sglang_keys_bigrams, speculative_algorithms

    rows = []
    try:
        reg = systems.registration()
    except OracleUnavailable as exc:
        for mode in modes:
            rows.append(RowResult("card", mode, "base", 0, 1, 0.0, Cause.CARD_UNAVAILABLE.value, Cause.CARD_UNAVAILABLE.name,
                                  str(exc)))
        return rows
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


def run_check(hasher: RouterHasher, make_cache: Callable[[int, bool], Any], make_index: Callable[[], Any], *,
              examples: int, props: tuple[str, ...] = DEFAULT_PROPERTIES, modes: tuple[str, ...] = MODES,
              variants: tuple[str, ...] = tuple(VARIANTS), seed: int | None = None,
              progress: Callable[[RowResult], None] | None = None, systems: Systems | None = None,
              ingest_examples: int = 25, tier_examples: int | None = None, page_size: int | None = None,
              event_format: str = "default", dp_examples: int | None = None,
              mm_examples: int | None = None) -> list[RowResult]:
    """Run every requested property x mode x variant and return one row each; ``page_size`` pins the
    page size of every generated case (None: every size the strategies draw). ``event_format``: the
    KV-event format ``make_cache``'s caches publish in (and the tier rows'), carried by every row of a
    property that reads events; the others say "any"."""
    systems = systems or Systems(hasher, make_cache, make_index)
    rows: list[RowResult] = []

    def emit(row: RowResult) -> None:
        row.event_format = (event_format if row.prop in EVENT_PROPERTIES
                            else "default" if row.prop in DEFAULT_FORMAT_PROPERTIES else "any")
        _capability_note(hasher, row)
        rows.append(row)
        if progress:
            progress(row)

    try:
        for prop in props:
            if prop == "card":
                for row in run_card(systems, modes):
                    emit(row)
                continue
            if prop == "advertised":
                from kvalign.verify.advertised import run_advertised_rows

                for row in run_advertised_rows(modes, page_size):
                    emit(row)
                continue
            if prop == "dp":
                from kvalign.verify.dp import DP_EXAMPLES, run_dp_rows

                for row in run_dp_rows(systems.router_path, modes, min(examples, dp_examples or DP_EXAMPLES), run_search,
                                       seed=seed, page_size=page_size):
                    emit(row)
                continue
            if prop == "mm":
                from kvalign.verify.mm import MM_EXAMPLES, run_mm_rows

                for row in run_mm_rows(systems, modes, min(examples, mm_examples or MM_EXAMPLES), seed,
                                       page_size=page_size):
                    emit(row)
                continue
            if prop in ("tier", "servable"):
                from kvalign.verify.tier import TIER_EXAMPLES, run_tier_rows

                for row in run_tier_rows(systems, prop, modes, variants, min(examples, tier_examples or TIER_EXAMPLES), seed,
                                         page_size=page_size, event_format=event_format):
                    emit(row)
                continue
            try:
                body = property_body(prop, hasher, make_cache, make_index, systems)
            except OracleUnavailable as exc:  # the relay / router of this release cannot start here
                for mode in modes:
                    for variant in variants:
                        emit(RowResult(prop, mode, variant, 0, 1, 0.0, Cause.PATH_UNAVAILABLE.value,
                                       Cause.PATH_UNAVAILABLE.name, str(exc)))
                continue
            n = min(examples, ingest_examples) if prop in ("ingest", "tenants") else examples
            for mode in modes:
                for variant in variants:
                    if prop == "tenants" and variant == "base":  # one tenant: nothing to keep apart
                        continue
                    start = time.perf_counter()
                    calls, failures, found = run_search(body, strategy_for(prop, mode, variant, page_size), n, seed=seed)
                    row = RowResult(prop, mode, variant, calls, failures, time.perf_counter() - start)
                    if found is not None:
                        row.cause, row.cause_name, row.detail = found.cause.value, found.cause.name, found.detail
                        row.counterexample = _plain(found.example)
                    emit(row)
    finally:
        systems.close()
    return rows
