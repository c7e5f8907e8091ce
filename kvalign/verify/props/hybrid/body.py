"""The ``hybrid`` property: the router's credit against what SGLang can reuse for a hybrid model.

A sliding-window (SWA) or Mamba model keeps, beside the full-attention KV the router indexes, state
SGLang evicts on its own, with no removal published; SGLang then reuses a prefix only up to the
last point where that state survives (sglang #23678, #24718, #26387, RFC #40865; dynamo DEP
#12169), and a Mamba tree holds state only at node ends. Each example drives SGLang's real
``UnifiedRadixCache`` with that component (:class:`~kvalign.oracles.hybrid.HybridCache`) through
generated inserts, full evictions and window/Mamba-only evictions; after every step SGLang's events
go through the ``ingest`` path (SGLang's real ``ZmqEventPublisher`` -> Dynamo's real worker relay ->
a real ``KvRouter``) and for every cached prompt and a cut of it:

* router ``device_blocks`` == SGLang's full-attention prefix (``full_kv_hit_length``): what its
  events stored and did not remove. Otherwise the index diverged (``INGEST_STALE`` above it,
  ``EVENTS_DROPPED`` below it, ``ROUTER_EAGLE_ON`` where the keys differ: cache-blind);
* router ``device_blocks`` == SGLang's reusable prefix (``device_prefix_len``). The router above it
  with the index right is the hybrid finding, ``SWA_STATE_NOT_REUSABLE`` / ``MAMBA_STATE_NOT_REUSABLE``:
  the keys agree, but no event says the state is gone and no constant of the packages bounds the credit
  (a whole prefix can be credited and none of it reused), so it is cache-blind by
  :func:`kvalign.model.causes.cause_class`; the row keeps the largest skew seen.

Each row has a negative control: the same search with SGLang's removals dropped before the relay
(:func:`drop_removals`), which the property must report as ``INGEST_STALE``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from kvalign.model.causes import Cause
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.engine.search import Tally

#: Page sizes per component: a Mamba tree without its extra buffer needs page size 1; with it, larger.
PAGE_SIZES = {"swa": (2, 4), "mamba": (1, 4)}
#: Sliding windows drawn (tokens): below, at and above a page.
WINDOWS = (2, 4, 8)
#: Generated examples per row, and per negative control.
HYBRID_EXAMPLES = 20
CONTROL_EXAMPLES = 10
#: Steps per example.
MAX_STEPS = 8

Step = tuple[Any, ...]


@dataclass
class Scenario:
    component: str
    page_size: int
    eagle: bool
    window: int
    core: str
    steps: list[Step] = field(default_factory=list)


@st.composite
def hybrid_scenarios(draw: st.DrawFn, component: str, eagle: bool, page_sizes: tuple[int, ...] | None = None) -> Scenario:
    """Inserts (often extending an earlier prompt; for SWA also requests cached as decoded, their out-of-window
    slots freed mid-request), full evictions, state-only evictions, and the prompt cuts checked after each step
    (tokens from a vocabulary of 4, so prompts share prefixes)."""
    from kvalign.oracles.hybrid import CORES

    p = draw(st.sampled_from(page_sizes or PAGE_SIZES[component]), label="page_size")
    sc = Scenario(component, p, eagle, draw(st.sampled_from(WINDOWS), label="window"),
                  draw(st.sampled_from(CORES), label="core"))
    prompts: list[list[int]] = []
    # an SWA request may also be cached as SGLang's production path caches a decoded one: its window slots
    # behind the sliding window freed while it ran, the most common window tombstone (HybridCache.insert_decoded)
    inserts = ("insert", "decode_insert") if component == "swa" else ("insert", "insert")
    for i in range(draw(st.integers(2, MAX_STEPS), label="steps")):
        kinds = inserts if i == 0 else (*inserts, "evict_state", "evict")
        kind = draw(st.sampled_from(kinds), label="kind")
        if kind in ("insert", "decode_insert"):
            prefix: list[int] = []
            if prompts and draw(st.booleans(), label="extends"):
                doc = draw(st.sampled_from(prompts))
                prefix = doc[: draw(st.integers(0, len(doc)), label="cut")]
            tokens = prefix + draw(st.lists(st.integers(0, 3), min_size=p + eagle, max_size=3 * p + eagle), label="new")
            prompts.append(tokens)
            sc.steps.append((kind, tokens))
        elif kind == "evict_state":
            sc.steps.append(("evict_state", draw(st.integers(1, 3 * p if component == "swa" else 2), label="amount")))
        else:
            sc.steps.append(("evict", draw(st.integers(1, 3), label="pages") * p))
    return sc


def apply_step(cache: Any, step: Step, shift: Callable[[list[int]], list[int]]) -> None:
    """One scenario step on a :class:`~kvalign.oracles.hybrid.HybridCache` (its prompts shifted by ``shift``)."""
    kind = step[0]
    if kind == "insert":
        cache.insert(shift(step[1]))
    elif kind == "decode_insert":
        cache.insert_decoded(shift(step[1]))
    elif kind == "evict":
        cache.evict(step[1])
    elif kind == "evict_state":
        cache.evict_state(step[1])
    else:
        raise ValueError(f"unknown hybrid step {kind!r}")


def drop_removals(raw: list[Any]) -> list[Any]:
    """The negative control: SGLang's ``BlockRemoved`` events never reach the relay."""
    return [ev for ev in raw if type(ev).__name__ != "BlockRemoved"]


#: The token a query goes on with past its cut (outside the drawn alphabet 0..3, so it never extends a cached page).
TAIL_TOKEN = 4


def _cuts(prompts: list[list[int]], p: int, eagle: bool) -> list[list[int]]:
    """Every cached prompt and every page-aligned prefix of it, each followed by one more token: a prefix
    ending at or inside a node whose window / Mamba state is gone (or never kept) is where the two sides
    part. The extra token is a request going on past the prefix: SGLang's scheduler matches at most all but
    a prompt's last token (``Req._compute_max_prefix_len``), so a query ending on a page boundary could never
    reuse its last page whatever the state, and the router's credit for it is the scoped
    ``LAST_PAGE_CAPPED``, not a hybrid finding. With it, every page the router credits is one SGLang's
    scheduler would reuse were the state there (the router's block count is unchanged by one token)."""
    out: dict[tuple[int, ...], None] = {}
    for t in prompts:
        for n in [*range(p + eagle, len(t), p), len(t)]:
            out[(*t[:n], TAIL_TOKEN)] = None
    return [list(t) for t in out]


def judge(component: str, eagle_card: bool, keys_eagle: bool, p: int, router: int, reusable: int, full: int,
          tokens: list[int]) -> tuple[Cause, str, int] | None:
    """Name a disagreement between the router's credit (blocks) and SGLang (units); None when they agree.
    Returns (cause, detail, blocks credited past SGLang's reusable prefix: the skew's size)."""
    u, f = reusable // p, full // p
    if router == u:
        return None
    what = (f"prompt {tokens}: the router credits {router} block(s); SGLang holds {f} full-attention page(s) "
            f"and can reuse {u}")
    if router != f:
        if router > f:
            return Cause.INGEST_STALE, f"{what}: the router holds {router - f} block(s) SGLang removed", router - u
        if eagle_card and not keys_eagle and router == 0:
            return (Cause.ROUTER_EAGLE_ON, f"{what}: the worker's card registers EAGLE (dynamo.sglang sets enable_eagle "
                    "from the speculative algorithm alone), so the router hashes bigram windows, while SGLang keys "
                    "and publishes this tree in plain tokens: cache-blind", 0)
        return Cause.EVENTS_DROPPED, f"{what}: the router indexed {f - router} fewer", 0
    cause = Cause.SWA_STATE_NOT_REUSABLE if component == "swa" else Cause.MAMBA_STATE_NOT_REUSABLE
    return (cause, f"{what}: {router - u} credited block(s) lie past the last point where SGLang holds the "
            f"{'sliding-window KV' if component == 'swa' else 'Mamba state'} (no removal is published for it); "
            "class: cache-blind (the keys agree, but no event says the state is gone; no constant bounds the credit)", router - u)


SKEWS = (Cause.SWA_STATE_NOT_REUSABLE, Cause.MAMBA_STATE_NOT_REUSABLE)


class HybridRun:
    """One row's search: the router path shared, a fresh SGLang hybrid cache per example.

    ``mutate`` changes SGLang's events before the relay (the negative control); ``tolerate_skew``
    lets the hybrid credit skew pass so that a control's own cause is what it reports;
    ``card_as_keys`` registers the worker with the EAGLE flag SGLang keys the tree with (the control
    of a row that is cache-blind by its card, where no dropped removal could show)."""

    def __init__(self, path: Any, component: str, eagle: bool, *, mutate: Callable[[list[Any]], list[Any]] | None = None,
                 tolerate_skew: bool = False, card_as_keys: bool = False,
                 make_cache: Callable[..., Any] | None = None) -> None:
        from kvalign.oracles.hybrid import HybridCache, eagle_allowed

        self.path, self.component, self.eagle, self.mutate = path, component, eagle, mutate
        self.tolerate_skew, self.card_as_keys = tolerate_skew, card_as_keys
        self.make_cache = make_cache or HybridCache
        self.plain_keys_note = eagle_allowed(component) if eagle else None
        #: the search's calls; every count below is of generated examples, never of shrink steps (issue 43)
        self.tally = Tally()
        #: the largest skew seen in blocks, the credited blocks it was seen with, and examples that showed one
        self.bound, self.bound_of, self.skewed = 0, 0, 0
        #: examples in which SGLang's reusable prefix fell short of its full-attention one somewhere (window
        #: KV or Mamba state evicted or never kept): the only ones the row's subject shows in (none: ``n/a``)
        self.short = 0

    def __call__(self, sc: Scenario) -> None:
        try:
            cache = self.make_cache(sc.component, sc.page_size, eagle=sc.eagle, window=sc.window, core=sc.core)
        except OracleUnavailable as exc:
            raise Mismatch("hybrid", str(exc), Cause.PATH_UNAVAILABLE, sc) from None
        card = bool(cache.eagle_keys) if self.card_as_keys else sc.eagle
        try:
            worker = self.path.worker(sc.page_size, card)
        except OracleUnavailable as exc:
            raise Mismatch("hybrid", str(exc), Cause.PATH_UNAVAILABLE, sc) from None
        if not worker.barrier():  # the relay's subscription is live before SGLang's first batch (ZMQ's slow joiner)
            raise Mismatch("hybrid", f"the relay never indexed a plain one-page SGLang event (Dynamo "
                           f"{self.path.version})", Cause.PATH_UNAVAILABLE, sc)
        base = worker.token_space()
        shift = lambda t: [base + x for x in t]  # noqa: E731 - this example's own token range
        prompts: list[list[int]] = []
        skewed = short = False
        for i, step in enumerate(sc.steps):
            if step[0] in ("insert", "decode_insert"):
                prompts.append(step[1])
            apply_step(cache, step, shift)
            raw = cache.take_raw_events()
            if self.mutate:
                raw = self.mutate(raw)
            if raw:
                worker.publisher.publish(raw)
            if not worker.barrier():
                raise Mismatch("hybrid", f"the relay stopped indexing (Dynamo {self.path.version})", Cause.EVENTS_DROPPED, sc)
            findings = []
            for tokens in _cuts(prompts, sc.page_size, bool(cache.eagle_keys)):
                reuse = cache.match(shift(tokens))
                short = short or reuse.reusable < reuse.full
                router = self.path.query_overlap(worker.router, shift(tokens), None, None)
                found = judge(sc.component, card, bool(cache.eagle_keys), sc.page_size, router, reuse.reusable,
                              reuse.full, tokens)
                if found is None:
                    continue
                if found[0] in SKEWS:
                    skewed = True
                    if found[2] > self.bound and self.tally.generating:  # a shrink step's skew is no example's
                        self.bound, self.bound_of = found[2], router
                    if self.tolerate_skew:
                        continue
                findings.append((found, tokens))
            if findings:
                self._count(skewed, short)
                # an index divergence (keys or events) outranks the skew: it is what the row then shows
                (cause, detail, skew), tokens = min(findings, key=lambda f: f[0][0] in SKEWS)
                raise Mismatch("hybrid", f"after step {i + 1} ({step[0]}), {detail}", cause,
                               {"component": sc.component, "page_size": sc.page_size, "eagle": sc.eagle,
                                "window": sc.window if sc.component == "swa" else None, "core": cache.core,
                                "steps": sc.steps[: i + 1], "query": tokens},
                               condition=hybrid_condition(sc.component) if cause in SKEWS else None)
        self._count(skewed, short)

    def _count(self, skewed: bool, short: bool) -> None:
        """An example's counts, if it is a generated example (:class:`~kvalign.verify.engine.search.Tally`)."""
        if self.tally.generating:
            self.skewed += skewed
            self.short += short


def unexercised(body: HybridRun, component: str, calls: int) -> str | None:
    """Why a row whose search found nothing checked nothing of its subject (the row is then ``n/a``, never
    ``ok``), or None. Its subject is the router's credit where SGLang's reusable prefix is shorter than the
    full-attention prefix the router indexes; an example in which the two never parted checked only what
    ``ingest`` checks, and a row of such examples could not have failed with a hybrid cause (issue 43)."""
    if body.short:
        return None
    state = "sliding-window KV" if component == "swa" else "Mamba state"
    return (f"ran {calls} example(s), none exercising what this row checks: SGLang's reusable prefix never fell short "
            f"of its full-attention prefix (no {state} evicted or missing), so the router's credit was never held "
            "against lost state (more --hybrid-examples)")


def exercised(body: HybridRun, component: str, calls: int) -> str:
    """An ``ok`` (or ``n/a``) row's detail: how many of its examples lost state."""
    state = "sliding-window KV" if component == "swa" else "Mamba state"
    return (f"SGLang's reusable prefix fell short of its full-attention prefix ({state} evicted or missing) in "
            f"{body.short} of {calls} example(s)")


def hybrid_condition(component: str) -> str:
    if component == "swa":
        return ("only for sliding-window hybrid models (UnifiedRadixCache with an SWA component), after SGLang "
                "frees a request's window KV behind its window while it runs, or evicts window KV alone; dense models "
                "and the full-attention keys are unaffected")
    return ("only for Mamba / linear-attention hybrid models (UnifiedRadixCache with a MAMBA component): prefixes "
            "ending where SGLang holds no Mamba state; dense models and the full-attention keys are unaffected")


def control_search(path: Any, component: str, eagle: bool, sizes: tuple[int, ...] | None = None,
                   examples: int = CONTROL_EXAMPLES, seed: int | None = None) -> tuple[int, Mismatch | None]:
    """A row's negative control: the search with SGLang's removals dropped (:func:`drop_removals`); returns its
    generated examples and the mismatch it found (expected: ``INGEST_STALE``), or None.

    Not shrunk: the row keeps whether, and for which cause, the control failed, never its example, and
    shrinking it through the relay and router was most of the control's calls (issue 45)."""
    from kvalign.verify.engine.search import run_search

    body = HybridRun(path, component, eagle, mutate=drop_removals, tolerate_skew=True, card_as_keys=True)
    calls, _failures, found = run_search(body, hybrid_scenarios(component, eagle, sizes), examples, seed=seed,
                                         shrink=False)
    return calls, found


def run_hybrid_rows(systems: Any, modes: tuple[str, ...], examples: int, seed: int | None = None,
                    page_size: int | None = None) -> list[Any]:
    """``check``'s hybrid rows: variant ``swa`` and ``mamba`` per mode, each with its negative control."""
    from kvalign.oracles.hybrid import version_problem
    from kvalign.oracles.sglang import sglang_version
    from kvalign.verify.engine.rows import RowResult
    from kvalign.verify.engine.search import run_search

    skipped = version_problem(sglang_version())
    if skipped:
        return [RowResult("hybrid", m, c, skipped=skipped) for m in modes for c in ("swa", "mamba")]
    rows: list[Any] = []
    try:
        path = systems.router_path()
    except OracleUnavailable as exc:
        return [RowResult("hybrid", m, c, 0, 1, 0.0, Cause.PATH_UNAVAILABLE.value, Cause.PATH_UNAVAILABLE.name, str(exc))
                for m in modes for c in ("swa", "mamba")]
    for mode in modes:
        for component in ("swa", "mamba"):
            eagle = mode == "eagle"
            sizes = (page_size,) if page_size else PAGE_SIZES[component]
            start = time.perf_counter()
            body = HybridRun(path, component, eagle)
            try:
                calls, failures, found = run_search(body, hybrid_scenarios(component, eagle, sizes), examples, seed=seed,
                                                    tally=body.tally)
            except OracleUnavailable as exc:
                rows.append(RowResult("hybrid", mode, component, 0, 1, time.perf_counter() - start,
                                      Cause.PATH_UNAVAILABLE.value, Cause.PATH_UNAVAILABLE.name, str(exc)))
                continue
            row = RowResult("hybrid", mode, component, calls, failures, time.perf_counter() - start)
            row.shrink_steps = body.tally.shrink_steps
            if found is None:  # a pass, or n/a where no example lost state
                row.skipped, row.detail = unexercised(body, component, calls), exercised(body, component, calls)
            else:
                row.cause, row.cause_name, row.detail = found.cause.value, found.cause.name, found.detail
                row.counterexample, row.condition = found.example, found.condition
                if body.plain_keys_note and found.cause is Cause.ROUTER_EAGLE_ON:
                    row.detail += f" [{body.plain_keys_note}]"
            if body.bound:
                row.detail = (f"{row.detail}; bound seen: up to {body.bound} of {body.bound_of} credited block(s) past "
                              f"SGLang's reusable prefix (examples showing the skew: {body.skewed} of {calls}); not "
                              "bounded by a constant: state evicted at a prompt's end can leave none of it reusable")
            c_calls, c_found = control_search(path, component, eagle, sizes, seed=seed)
            row.control = {"mutation": "drop_removals (SGLang's BlockRemoved never reaches the relay)",
                           "worker card": "EAGLE as SGLang keys the tree", "cases": c_calls,
                           "failed": c_found is not None and c_found.cause is Cause.INGEST_STALE,
                           "cause": c_found.cause.name if c_found is not None else None,
                           "expected": Cause.INGEST_STALE.name}
            rows.append(row)
    return rows
