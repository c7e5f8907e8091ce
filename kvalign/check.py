"""``kvalign check``'s engine: run the alignment properties as Hypothesis searches, outside pytest.

A CI job or an engineer with a patched router wants one answer — aligned or not — plus, for a
failure, the smallest input that shows it and a named cause. Hypothesis gives the search and the
shrinking; this module runs each property x mode x variant, counts cases, and keeps the shrunk
counterexample (the last exception Hypothesis raises is the one from the minimal example).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvalign.oracles.base import RouterHasher
from kvalign.properties import Mismatch, hash_property, overlap_property, pages_property
from kvalign.strategies import hash_cases, scenarios

PROPERTIES = ("hash", "pages", "overlap")
MODES = ("plain", "eagle")
VARIANTS = {"base": (False, False), "lora": (True, False), "namespace": (False, True), "lora+namespace": (True, True)}


@dataclass
class RowResult:
    """One property x mode x variant run."""

    prop: str
    mode: str
    variant: str
    cases: int = 0
    mismatches: int = 0
    seconds: float = 0.0
    cause: str | None = None
    detail: str | None = None
    counterexample: Any = None

    @property
    def ok(self) -> bool:
        return self.mismatches == 0


def run_search(body: Callable[[Any], None], strategy: st.SearchStrategy[Any], examples: int, *, seed: int | None = None) -> tuple[int, int, Mismatch | None]:
    """Search ``strategy`` for an input on which ``body`` raises :class:`Mismatch`.

    Returns (cases run, failing cases seen, shrunk mismatch or None). Any other exception is a
    bug in the harness or an oracle and propagates.
    """
    calls = failures = 0

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, print_blob=False,
              phases=(Phase.explicit, Phase.generate, Phase.shrink))
    @given(strategy)
    def search(value: Any) -> None:
        nonlocal calls, failures
        calls += 1
        try:
            body(value)
        except Mismatch:
            failures += 1
            raise

    if seed is not None:
        from hypothesis import seed as hseed

        search = hseed(seed)(search)
    try:
        search()
    except Mismatch as found:
        return calls, failures, found
    return calls, failures, None


def property_body(prop: str, hasher: RouterHasher, make_cache: Callable[[int, bool], Any], make_index: Callable[[], Any]) -> Callable[[Any], None]:
    """The per-example function for one property, bound to the systems under test."""
    if prop == "hash":
        return lambda case: hash_property(hasher, case)
    if prop == "pages":
        return lambda sc: pages_property(hasher, make_cache, sc)
    if prop == "overlap":
        return lambda sc: overlap_property(hasher, make_cache, make_index, sc)
    raise ValueError(f"unknown property {prop!r}")


def strategy_for(prop: str, mode: str, variant: str) -> st.SearchStrategy[Any]:
    lora, namespace = VARIANTS[variant]
    eagle = mode == "eagle"
    if prop == "hash":
        return hash_cases(eagle=eagle, lora=lora, namespace=namespace, mm=variant == "base")
    return scenarios(eagle=eagle, lora=lora, namespace=namespace)


def _plain(value: Any) -> Any:
    return asdict(value) if is_dataclass(value) else value


def run_check(hasher: RouterHasher, make_cache: Callable[[int, bool], Any], make_index: Callable[[], Any], *,
              examples: int, props: tuple[str, ...] = PROPERTIES, modes: tuple[str, ...] = MODES,
              variants: tuple[str, ...] = tuple(VARIANTS), seed: int | None = None,
              progress: Callable[[RowResult], None] | None = None) -> list[RowResult]:
    """Run every requested property x mode x variant and return one row each."""
    rows = []
    for prop in props:
        body = property_body(prop, hasher, make_cache, make_index)
        for mode in modes:
            for variant in variants:
                start = time.perf_counter()
                calls, failures, found = run_search(body, strategy_for(prop, mode, variant), examples, seed=seed)
                row = RowResult(prop, mode, variant, calls, failures, time.perf_counter() - start)
                if found is not None:
                    row.cause, row.detail, row.counterexample = found.cause.value, found.detail, _plain(found.example)
                rows.append(row)
                if progress:
                    progress(row)
    return rows
