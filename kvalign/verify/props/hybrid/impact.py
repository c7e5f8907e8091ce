"""The hybrid findings' routing impact, measured on the real router as the host-credit finding's is (issue 43).

``SWA_STATE_NOT_REUSABLE`` and ``MAMBA_STATE_NOT_REUSABLE`` say the router credits full-attention blocks
SGLang cannot reuse; whether that moves a request is asked of a real ``KvRouter`` with two candidates
(:class:`~kvalign.oracles.router_pair.RouterPair`): rank 0 is SGLang's real hybrid cache after the finding's
steps (its events through SGLang's publisher and Dynamo's relay), rank 1 a fresh hybrid cache of the same
kind holding the query's first ``k`` pages intact. For every ``k`` the router routes the query
:data:`~kvalign.oracles.router_pair.ROUTES` times and each cache says what it reuses (``match_prefix``'s
``device_prefix_len``; the query goes on one token past its pages, as the property's queries do). The row's
``changes_worker`` is whether the router ever picks, every time, the candidate that reuses less: its class
(cache-blind) rests on that measurement, not on the rule that an unbounded cause is cache-blind. A tie is
reported as a tie.

Two states are measured: the row's counterexample (often shrunk to a one-block skew, where no choice can
flip: the other candidate then holds as many reusable pages, or more credit), and the state SGLang's own
production path leaves at its worst (:data:`WORST`): for SWA a request decoded past its window, whose
out-of-window slots SGLang freed while it ran (``HybridCache.insert_decoded``); for Mamba a request cached
whole, whose state SGLang keeps only at the node's end, queried at a prefix of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvalign.model.causes import Cause
from kvalign.verify.engine.trials import Trial, tie_share, trials_said, worst_flip
from kvalign.verify.engine.rows import RowResult

HYBRID_CAUSES = frozenset({Cause.SWA_STATE_NOT_REUSABLE.name, Cause.MAMBA_STATE_NOT_REUSABLE.name})
#: Pages of the worst-case state: the request's pages, of which the query keeps all but the last two.
WORST_PAGES = 8


@dataclass
class HybridImpact:
    """The real router's choices on a hybrid cache's state against a candidate holding the query's prefix intact."""

    component: str
    page_size: int
    eagle: bool
    what: str  # the state, in words
    credited: int  # blocks the router credits rank 0 for the query
    reusable: int  # pages SGLang's rank-0 cache reuses of them
    trials: list[Trial] = field(default_factory=list)

    @property
    def changes_worker(self) -> bool:
        return any(t.changed for t in self.trials)

    def says(self) -> str:
        state = (f"{self.component}, page size {self.page_size}{' (EAGLE)' if self.eagle else ''}, {self.what}: the "
                 f"router credits {self.credited} block(s), SGLang reuses {self.reusable} page(s)")
        flips = [t for t in self.trials if t.changed]
        if flips:
            t = worst_flip(flips)  # the largest loss
            return (f"changes the worker for {len(flips)} of {len(self.trials)} k ({', '.join(str(f.k) for f in flips)})"
                    f": {state}; with the other holding {t.k} page(s) intact the router picks the "
                    f"{'first' if t.chosen == 0 else 'other'} every time, which reuses {t.reused[t.chosen]} where the "
                    f"{'other' if t.chosen == 0 else 'first'} would reuse {t.reused[1 - t.chosen]}; "
                    f"{tie_share(self.trials)}")
        ks = trials_said(self.trials)
        return (f"does not change the worker: {state}; other candidate holding k pages intact: {ks}; "
                f"{tie_share(self.trials)}")

    def as_dict(self) -> dict[str, Any]:
        return {"component": self.component, "page_size": self.page_size, "eagle": self.eagle, "state": self.what,
                "credited": self.credited, "reusable": self.reusable, "trials": [t.as_dict() for t in self.trials]}


def _core(name: str) -> str:
    """The oracle's core argument for a counterexample's ``core`` (the tree core's class name, or the argument)."""
    return "rust" if "rust" in name.lower() else "python"


def measure_hybrid_routing(example: dict[str, Any], path: Any, what: str) -> HybridImpact:
    """Replay ``example`` (a hybrid row's counterexample: component, page_size, eagle, window, core, steps, query)
    into rank 0, and for k = 0 .. the blocks the router credits it, a rank 1 holding the query's first k pages."""
    from kvalign.oracles.hybrid import HybridCache
    from kvalign.oracles.router_pair import RouterPair
    from kvalign.verify.props.hybrid.body import apply_step

    comp, p, eagle = example["component"], int(example["page_size"]), bool(example["eagle"])
    window, core = int(example.get("window") or 4), _core(str(example.get("core") or "rust"))
    make = lambda: HybridCache(comp, p, eagle=eagle, window=window, core=core)  # noqa: E731
    a, b = make(), make()
    pair = RouterPair(path, p, eagle)
    try:
        base = 3 << 20  # this measurement's own token range of the long-lived router
        shift = lambda t: [base + x for x in t]  # noqa: E731
        for step in example["steps"]:
            apply_step(a, tuple(step), shift)
        query = shift(list(example["query"]))
        held = a.match(query)
        f, u = held.full // p, held.reusable // p
        impact = HybridImpact(comp, p, eagle, what, f, u)
        pair.publish(0, a.take_raw_events())
        for k in range(f + 1):  # rank 1's prefixes nest, so its index after k is its first k pages
            if k:
                b.insert(query[: k * p + b.eagle_keys])
            pair.publish(1, b.take_raw_events())
            pair.settle(query, {0: (f, 0), 1: (k, 0)})
            impact.trials.append(Trial(k, pair.picks(query), (a.match(query).reusable, b.match(query).reusable)))
    finally:
        pair.close()
    return impact


def worst(component: str, page_size: int, eagle: bool) -> tuple[dict[str, Any], str]:
    """The production path's state at its worst for this component, as a counterexample dict, and in words."""
    n = WORST_PAGES * page_size + int(eagle and component == "swa")
    tokens = [i % 4 for i in range(n)]
    query = tokens[: (WORST_PAGES - 2) * page_size + int(eagle and component == "swa")] + [4]
    if component == "swa":
        return ({"component": "swa", "page_size": page_size, "eagle": eagle, "window": page_size, "core": "rust",
                 "steps": [("decode_insert", tokens)], "query": query},
                f"a {n}-token request decoded past its {page_size}-token window (its out-of-window slots freed by "
                f"SGLang while it ran) and cached, queried at its first {WORST_PAGES - 2} pages")
    return ({"component": "mamba", "page_size": page_size, "eagle": eagle, "window": None, "core": "rust",
             "steps": [("insert", tokens)], "query": query},
            f"a {n}-token request cached whole (its Mamba state kept at the node's end only), queried at its first "
            f"{WORST_PAGES - 2} pages")


def assess_hybrid(r: RowResult, path: Any) -> None:
    """A hybrid row: the routing impact on its counterexample and on the production path's worst state."""
    ex = r.counterexample or {}
    missing = [k for k in ("component", "page_size", "eagle", "steps", "query") if ex.get(k) is None]
    if missing:
        raise ValueError(f"{r.prop}/{r.mode}/{r.variant}: the counterexample has no {', '.join(missing)}")
    on_ex = measure_hybrid_routing(ex, path, "the counterexample's state")
    bad, what = worst(ex["component"], int(ex["page_size"]), bool(ex["eagle"]))
    at_worst = measure_hybrid_routing(bad, path, what)
    r.changes_worker = on_ex.changes_worker or at_worst.changes_worker
    r.routing = {"counterexample": on_ex.as_dict(), "production_worst": at_worst.as_dict()}
    r.impact = (f"no constant bound (state evicted or never kept can leave none of a credited prefix reusable); on "
                f"the counterexample the router {on_ex.says()}; on SGLang's production path the router "
                f"{at_worst.says()}")
