"""The live invariants, evaluated on each request's :class:`Observation`.

Every request is seen three ways: what the router credited (``kv_hit_rate`` -> blocks, on the
worker it chose), what the engine reused (``cached_tokens``; in disaggregation the prefill
worker's own report), and what kvalign predicts from the captured events (:mod:`.views`).
Predictions are taken at the mark the request was routed at: the settled state before it was
sent (a burst request: before the burst; one whose credit a sibling could change is counted
``unattributable`` and not judged).

In the order they are evaluated (the first failure names the run's failure):

* ``engine_matches_index``: the engine saw the N tokens sent, and reused
  ``B * min(h, floor((N-2)/B))`` of them (EAGLE; ``N-1`` plain) for h = the engine view's leading
  pages of the prompt on that worker; a vLLM worker by vLLM's own rule
  (:func:`kvalign.live.engines.vllm_cpu.engine_reused_tokens`, whole blocks of the prompt minus its
  last token: the same count as SGLang's plain keys);
* ``router_credits_engine_reuse``: what "aligned" means to a user. The tokens the router
  credited on the worker it chose (``kv_hit_rate * ceil(N/B)`` blocks, recovered exactly, times B)
  equal the tokens that worker reused. The one allowed difference is SGLang's last-page rule
  (:func:`.views.last_page_overcredit`), counted as ``last_page_overcredits``. Not asked of a
  request whose pages the hop deliberately lost (``hop_faulted``: the router *should* then
  disagree with the engine; the two invariants below judge it);
* ``router_matches_prediction``: credited blocks == the leading blocks of the prompt in the router
  view (the engine's batches the hop delivered), so on a hop-faulted request the router credits
  exactly what it was told, no more and no less;
* ``no_stale_credit``: credited blocks <= the engine view's leading pages: never a page whose
  removal or clear the engine published (fails alone when the hop loses a removal);
* ``best_worker_chosen``: a request sent alone, with one worker strictly best in the router view,
  went to that worker;
* ``decode_keeps_speculating``: requests sent alone and asked for at least :data:`MIN_SPEC_TOKENS`
  tokens moved their decode worker's verify counter and show accepted drafts
  (:func:`kvalign.live.wire.metrics.accept_failures`), judged over a window of up to ``--spec-window``
  such requests on one decode worker, one scrape per window (:mod:`.speculation`); "checked" counts windows;
* ``kv_transferred`` (disaggregation): a request sent alone handed its KV to decode over the transfer
  backend (bytes on prefill's transfer histogram) and SGLang's checksum verified it (:mod:`.transfers`).

Removed, because no fault of the system under test makes them fail alone: ``restart_forgotten``
(a request routed to a retired instance is a ``router_credits_engine_reuse`` finding, and a
restarted worker's credit is held by the same invariant), and ``gap_diagnosed`` (``kvalign
diagnose`` names a lost batch from the orphaned stores after it even when a hop renumbers the
stream to hide the gap; a lost store is reported as ``lost_batches_diagnosed``, not judged).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvalign.live.engines.vllm_cpu import engine_reused_tokens
from kvalign.live.runs.fuzz.views import credited_blocks, engine_cached_tokens, last_page_overcredit
from kvalign.live.wire.client import Completion

INVARIANTS = ("router_credits_engine_reuse", "router_tiers_match_engine", "router_matches_prediction",
              "engine_matches_index", "no_stale_credit", "best_worker_chosen", "routed_rank_served",
              "decode_keeps_speculating", "kv_transferred", "routers_agree")
#: Invariants of some runs only (router replicas: :mod:`.replicas`; data-parallel ranks: :mod:`.dp_ranks`;
#: disaggregation: :mod:`.transfers`), left out of a run's JSON when never checked.
OPTIONAL = ("routers_agree", "routed_rank_served", "kv_transferred")
#: What the router credited, judged against the engine and kvalign's views: not judged with an
#: approximate router (``--router-mode approx`` predicts from routing decisions; measured instead).
ROUTER_JUDGED = ("router_credits_engine_reuse", "router_tiers_match_engine", "router_matches_prediction",
                 "no_stale_credit", "best_worker_chosen")

#: Fewest generated tokens for which tokens-per-verify can tell accepted drafts from none: the first
#: token comes from the prefill forward, and with one draft token per verify (the CPU engine) two
#: more tokens take one verify step when drafts are accepted and two when they are not.
MIN_SPEC_TOKENS = 3


class InvariantFailed(AssertionError):
    """One invariant failed on one request: which, why (a cause name), and the numbers."""

    def __init__(self, invariant: str, detail: str, *, cause: str = "none", worker: str | None = None,
                 request: int | None = None, numbers: dict[str, Any] | None = None, failing: list[str] | None = None,
                 evidence: dict[str, Any] | None = None) -> None:
        super().__init__(f"{invariant}: {detail} (cause: {cause})")
        self.invariant, self.detail, self.cause = invariant, detail, cause
        self.worker, self.request = worker, request
        self.numbers = dict(numbers or {})
        #: every invariant the request failed, in evaluation order (``invariant`` is the first)
        self.failing = list(failing or [invariant])
        #: what the cause was named from (the engine's recorded stream and its replay command), if anything
        self.evidence = evidence


@dataclass
class Tally:
    """How often each invariant was checked and failed, and the requests judged differently."""

    checked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INVARIANTS, 0))
    failed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INVARIANTS, 0))
    last_page_overcredits: int = 0  # router credited one block more than reused, by the last-page rule
    hop_faulted: int = 0  # requests whose pages the hop lost on purpose: router_credits_engine_reuse not asked
    unattributable: int = 0  # burst requests whose credit a sibling's stores or evictions could change

    def as_json(self) -> dict[str, dict[str, int]]:
        return {name: {"checked": self.checked[name], "failed": self.failed[name]} for name in INVARIANTS
                if name not in OPTIONAL or self.checked[name]}


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
    predicted: int  # router view: leading blocks of the prompt at the routing mark
    engine_held: int  # engine view: leading pages at that mark
    engine_tokens: int | None  # what the chosen worker reported reusing
    engine_surface: str = "usage.prompt_tokens_details.cached_tokens"
    hop_faulted: bool = False
    best: str | None = None  # the unique best worker in the router view (alone-sent requests only)
    stored_pages: int = 0  # engine view's leading pages of the prompt once the request settled
    engine_mark: int = 0  # the engine view's mark the request was routed at (its worker's batches then)
    engine_marks: dict[str, int] = field(default_factory=dict)  # every source's engine-view mark then
    salt: str | None = None  # the request's cache_salt
    #: the worker is vLLM: its reuse rule is :func:`kvalign.live.engines.vllm_cpu.engine_reused_tokens`
    vllm: bool = False

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def credited(self) -> int | None:
        return credited_blocks(self.completion.kv_hit_rate, self.n, self.block_size)

    @property
    def router_tokens(self) -> int | None:
        return None if self.credited is None else self.credited * self.block_size

    def cached_expected(self) -> int:
        if self.vllm:
            return engine_reused_tokens(self.engine_held, self.n, self.block_size)
        return engine_cached_tokens(self.engine_held, self.n, self.block_size, eagle=self.engine_eagle)

    def numbers(self) -> str:
        c = self.completion
        return (f"request {self.request}: {self.n} tokens -> {self.label} ({c.prefill_worker_id}), "
                f"kv_hit_rate {c.kv_hit_rate} = {self.credited} blocks = {self.router_tokens} tokens credited, "
                f"router view {self.predicted} blocks; engine reused {self.engine_tokens} ({self.engine_surface}), "
                f"engine view {self.engine_held} pages -> {self.cached_expected()} expected")


def evaluate(obs: Observation, tally: Tally, *, router_judged: bool = True) -> list[tuple[str, str]]:
    """(invariant, detail) for each invariant ``obs`` breaks, in evaluation order; updates ``tally``.
    ``router_judged=False`` (an approximate router) leaves out :data:`ROUTER_JUDGED`."""
    out: list[tuple[str, str]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        if not router_judged and name in ROUTER_JUDGED:
            return
        tally.checked[name] += 1
        if not ok:
            tally.failed[name] += 1
            out.append((name, detail))

    credited, c, b = obs.credited, obs.completion, obs.block_size
    if obs.label is None:
        check("router_credits_engine_reuse", False,
              f"request {obs.request}: the router chose {c.prefill_worker_id}, which is no live worker "
              "(an instance that was restarted away, or never registered)")
        return out
    check("engine_matches_index",
          c.prompt_tokens == obs.n and obs.engine_tokens == obs.cached_expected(),
          f"engine saw {c.prompt_tokens} of {obs.n} prompt tokens and reused {obs.engine_tokens}, kvalign's engine "
          f"view says {obs.cached_expected()}; {obs.numbers()}")
    if obs.hop_faulted:
        tally.hop_faulted += 1
    else:
        rt, et = obs.router_tokens, obs.engine_tokens
        overcredit = rt is not None and et is not None and last_page_overcredit(rt, et, obs.n, b, eagle=obs.engine_eagle)
        tally.last_page_overcredits += overcredit
        why = ("kv_hit_rate is no k/ceil(N/B): the router divides by another denominator" if credited is None
               else "the only allowed difference is the last page of a prompt fully cached at a page boundary")
        check("router_credits_engine_reuse", rt is not None and (rt == et or overcredit),
              f"router credited {rt} tokens, the engine reused {et} ({why}); {obs.numbers()}")
    check("router_matches_prediction", credited is not None and credited == obs.predicted,
          f"router credited {credited} blocks, kvalign's router view holds {obs.predicted}; {obs.numbers()}")
    check("no_stale_credit", credited is not None and credited <= obs.engine_held,
          f"router credited {credited} blocks but the engine held only {obs.engine_held} (it published their "
          f"removal); {obs.numbers()}")
    if obs.best is not None:
        check("best_worker_chosen", obs.label == obs.best,
              f"router chose {obs.label} but {obs.best} strictly held the most of the prompt; {obs.numbers()}")
    return out


def lost_pages_reused(lost: Observation, follow_up: Observation) -> bool:
    """Whether ``follow_up`` looked at the pages the hop lost from ``lost``'s store batch: those are
    the pages ``lost`` added to the engine view (``engine_held .. stored_pages - 1``), and the follow-up
    counts only when its engine view held all of them and the engine reused them (a follow-up that
    found them evicted, or reused fewer, looked at nothing the loss changed)."""
    if follow_up.engine_tokens is None or lost.stored_pages <= lost.engine_held:
        return False
    return (follow_up.engine_held >= lost.stored_pages
            and follow_up.engine_tokens >= lost.stored_pages * follow_up.block_size)


def failure_numbers(obs: Observation) -> dict[str, Any]:
    """The two numbers a user compares (``failure.router_tokens``, ``failure.engine_tokens``)."""
    return {"router_tokens": obs.router_tokens, "engine_tokens": obs.engine_tokens}


def observation_json(obs: Observation) -> dict[str, Any]:
    """The record a failure report and a replay keep for one request."""
    c = obs.completion
    return {"request": obs.request, "prompt_tokens": obs.n, "engine_prompt_tokens": c.prompt_tokens,
            "worker": obs.label, "worker_id": c.prefill_worker_id, "decode_worker_id": c.decode_worker_id,
            "concurrent": obs.concurrent, "kv_hit_rate": c.kv_hit_rate, "credited_blocks": obs.credited,
            "router_tokens": obs.router_tokens, "predicted_blocks": obs.predicted, "engine_tokens": obs.engine_tokens,
            "engine_surface": obs.engine_surface, "expected_engine_tokens": obs.cached_expected(),
            "engine_held_pages": obs.engine_held, "hop_faulted": obs.hop_faulted,
            "decoded_tokens": len(c.completion_token_ids),
            "tokens_per_verify": None}  # its speculation window's figure, once judged (.speculation)
