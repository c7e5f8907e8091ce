"""The six live invariants, evaluated on each request's :class:`Observation`.

Every request is seen three ways: what the router reported (``kv_hit_rate`` -> credited blocks,
and the worker it chose), what kvalign predicts from the captured events (:mod:`.views`), and
what the engine really reused (``cached_tokens``). Predictions are taken at the marks the request
was sent at: exactly one mark for a request sent alone on a settled cluster, every mark up to
its answer for a request in a concurrent burst (the router routed it at one of them; which one is
a race, not a finding).

* ``router_matches_prediction``: credited blocks == the router view's leading blocks of the prompt
  on the chosen worker (hashed the way the engine keys pages);
* ``engine_matches_index``: ``cached_tokens`` == ``B * min(h, floor((N-2)/B))`` (EAGLE; N-1 plain)
  for h = the engine view's leading pages of the prompt on that worker;
* ``no_stale_credit``: credited blocks <= the engine view's leading pages (never a block whose
  removal or clear the engine had published);
* ``best_worker_chosen``: a request sent alone, with one worker strictly best in the router view,
  went to that worker;
* ``gap_diagnosed``: after the hop lost a batch, ``kvalign diagnose`` on that worker's router-side
  capture names ``SEQUENCE_GAP`` for the prompt whose pages were lost;
* ``restart_forgotten``: after a restart, no request goes to the old instance id and the restarted
  worker is credited only with pages its new instance stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvalign.live.wire.client import Completion
from kvalign.live.runs.fuzz.views import credited_blocks, engine_cached_tokens

INVARIANTS = ("router_matches_prediction", "engine_matches_index", "no_stale_credit", "best_worker_chosen",
              "gap_diagnosed", "restart_forgotten")


class InvariantFailed(AssertionError):
    """One invariant failed on one request: which, why (a cause name), and the numbers."""

    def __init__(self, invariant: str, detail: str, *, cause: str = "none", worker: str | None = None,
                 request: int | None = None) -> None:
        super().__init__(f"{invariant}: {detail} (cause: {cause})")
        self.invariant, self.detail, self.cause = invariant, detail, cause
        self.worker, self.request = worker, request


@dataclass
class Tally:
    """How often each invariant was checked and failed."""

    checked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INVARIANTS, 0))
    failed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INVARIANTS, 0))

    def as_json(self) -> dict[str, dict[str, int]]:
        return {name: {"checked": self.checked[name], "failed": self.failed[name]} for name in INVARIANTS}


@dataclass
class Observation:
    """One answered request and every view of it kvalign needs for the checks."""

    request: int  # 1-based, within the run
    tokens: list[int]
    completion: Completion
    label: str | None  # the worker the router chose (None: an id no live worker has)
    concurrent: bool
    block_size: int
    engine_eagle: bool  # the engine keys pages by bigrams
    predicted: list[int]  # router view: leading blocks at each candidate mark
    engine_held: list[int]  # engine view: leading pages at each candidate mark
    best: str | None = None  # the unique best worker in the router view (alone-sent requests only)
    retired_ids: frozenset[int] = frozenset()  # instance ids restarted away in this example
    restarted: bool = False  # the chosen worker restarted earlier in this example

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def credited(self) -> int | None:
        return credited_blocks(self.completion.kv_hit_rate, self.n, self.block_size)

    def cached_expected(self) -> list[int]:
        return sorted({engine_cached_tokens(h, self.n, self.block_size, eagle=self.engine_eagle) for h in self.engine_held})

    def numbers(self) -> str:
        c = self.completion
        return (f"request {self.request}: {self.n} tokens -> {self.label} ({c.prefill_worker_id}), "
                f"kv_hit_rate {c.kv_hit_rate} = {self.credited} blocks credited, kvalign predicted "
                f"{_span(self.predicted)}; engine cached_tokens {c.cached_tokens}, kvalign expected "
                f"{_span(self.cached_expected())} from {_span(self.engine_held)} held pages")


def _span(values: list[int]) -> str:
    lo, hi = min(values, default=0), max(values, default=0)
    return str(lo) if lo == hi else f"{lo}..{hi}"


def evaluate(obs: Observation, tally: Tally) -> list[tuple[str, str]]:
    """(invariant, detail) for each invariant ``obs`` breaks; updates ``tally``."""
    out: list[tuple[str, str]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        tally.checked[name] += 1
        if not ok:
            tally.failed[name] += 1
            out.append((name, detail))

    credited, c = obs.credited, obs.completion
    if obs.label is None:
        check("router_matches_prediction", False,
              f"request {obs.request}: the router chose {c.prefill_worker_id}, which is no live worker")
        return out
    check("router_matches_prediction", credited is not None and credited in obs.predicted,
          f"router credited {credited} blocks, kvalign's router view holds {_span(obs.predicted)}; {obs.numbers()}")
    if c.cached_tokens is not None:
        check("engine_matches_index", c.cached_tokens in obs.cached_expected(),
              f"engine reused {c.cached_tokens} tokens, kvalign's engine view says {_span(obs.cached_expected())}; "
              f"{obs.numbers()}")
    check("no_stale_credit", credited is not None and credited <= max(obs.engine_held, default=0),
          f"router credited {credited} blocks but the engine held only {_span(obs.engine_held)}; {obs.numbers()}")
    if obs.best is not None:
        check("best_worker_chosen", obs.label == obs.best,
              f"router chose {obs.label} but {obs.best} strictly held the most of the prompt; {obs.numbers()}")
    if obs.retired_ids:
        ok = c.prefill_worker_id not in obs.retired_ids and (
            not obs.restarted or (credited is not None and credited <= max(obs.predicted, default=0)))
        check("restart_forgotten", ok,
              f"after a restart (retired ids {sorted(obs.retired_ids)}): {obs.numbers()}")
    return out


def observation_json(obs: Observation) -> dict[str, Any]:
    """The record a failure report and a replay keep for one request."""
    c = obs.completion
    return {"request": obs.request, "prompt_tokens": obs.n, "worker": obs.label, "worker_id": c.prefill_worker_id,
            "concurrent": obs.concurrent, "kv_hit_rate": c.kv_hit_rate, "credited_blocks": obs.credited,
            "predicted_blocks": obs.predicted, "cached_tokens": c.cached_tokens,
            "expected_cached_tokens": obs.cached_expected(), "engine_held_pages": obs.engine_held}
