"""The fuzz on data-parallel workers (``--dp-size N``): one view, one hop, one verdict per rank.

Each rank of a ``--dp-size N`` worker is a KV cache of its own with a KV-event stream of its own
(SGLang's port + rank), and Dynamo routes each request to one ``(instance, dp_rank)``. So the fuzz
treats every rank as a source (:mod:`kvalign.live.cluster.ranks`): its own lossy hop (Dynamo's
relay for rank r subscribes to rank r's hop, :func:`relay_subscriptions`), its own engine and
router views, and the worker a request ran on is the ``(prefill_worker_id, prefill_dp_rank)`` the
router reports. The invariants then hold per rank: the router's credit equals the engine's reuse on
the rank that served the request, and its prediction is that rank's view. This module adds:

* ``routed_rank_served``: the rank the router routed to (and credited) is the rank that served the
  request: once settled, the prompt's pages are on the routed rank's own stream. A request whose
  pages only another rank's stream stored *during* it fails; one whose pages no stream shows (or only
  a rank that held them already, as after a prompt ran on both) is not judged here
  (``engine_matches_index`` judges what the routed rank reused);
* per-rank figures: ``counts.requests_by_rank`` and, per rank, how often
  ``router_credits_engine_reuse`` was checked and failed and how many requests the router credited
  (which it can only do for a rank whose events it indexed);
* the cause of a failure on a rank that reused cached pages while its stream carried no batch since
  the example began (every example starts with every rank flushed): ``DP_RANK_UNPUBLISHED``;
* two rules. Left to itself the router sends a follow-up to a rank whose events it indexed, so a rank
  it cannot see may never serve a request that reuses its cache, and a rank that publishes nothing
  would go unnoticed (a generated run with ``--only-rank0-publishes`` and neither rule passed):
  ``sticky_follow_up``, a follow-up pinned to the rank that served its base prompt, as a gateway with
  session affinity sends it; ``every_rank``, a fresh prompt pinned to each rank in turn, each
  followed there by its follow-up, so every rank's reuse is judged at least once when it is drawn.

The control ``--only-rank0-publishes`` silences every other rank at its hop, for every subscriber
(Dynamo's relay and kvalign's engine view alike): what SGLang's schedulers did when only DP rank 0
published (sgl-project/sglang #16030); ``check --property dp`` runs that fault on SGLang's own
scheduler publishers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvalign.live.cluster import ranks
from kvalign.live.cluster.ports import LOOPBACK
from kvalign.model.causes import Cause
from kvalign.live.runs.fuzz.stores import stored_pages

ROUTED_RANK_SERVED = "routed_rank_served"
CREDIT = "router_credits_engine_reuse"


def relay_subscriptions(plan: Any, downstream: Mapping[str, int]) -> dict[str, str]:
    """Per worker, where ``dynamo.sglang``'s relay subscribes instead of SGLang's own PUB: the hop of
    its single source, or (several ranks) a JSON map from each rank's SGLang endpoint to its hop."""
    by_worker: dict[str, dict[str, str]] = {}
    for label, (worker, rank) in ranks.sources(plan).items():
        by_worker.setdefault(worker.name, {})[plan.kv_events_connect(worker, rank)] = f"tcp://{LOOPBACK}:{downstream[label]}"
    return {name: next(iter(hops.values())) if len(hops) == 1 else json.dumps(hops) for name, hops in by_worker.items()}


@dataclass
class RankFigures:
    """What the run saw per rank (the JSON's ``counts.requests_by_rank`` and the per-rank tallies)."""

    labels: list[str]
    served: dict[str, int] = field(default_factory=dict)
    credit_checked: dict[str, int] = field(default_factory=dict)
    credit_failed: dict[str, int] = field(default_factory=dict)
    credited: dict[str, int] = field(default_factory=dict)  # requests the router credited > 0 blocks on that rank

    def requests_by_rank(self) -> dict[str, int]:
        return {lab: self.served.get(lab, 0) for lab in self.labels}

    def by_rank(self) -> dict[str, dict[str, int]]:
        return {lab: {"checked": self.credit_checked.get(lab, 0), "failed": self.credit_failed.get(lab, 0),
                      "credited_requests": self.credited.get(lab, 0)} for lab in self.labels}


class DpRanks:
    """The per-rank part of a data-parallel fuzz run (module docstring), for one driver."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.figures = RankFigures(list(driver.labels))

    def judge(self, obs: Any, failures: list[tuple[str, str]], credit_before: tuple[int, int]) -> list[tuple[str, str]]:
        """Record ``obs`` per rank and add ``routed_rank_served``'s verdict to ``failures``."""
        f, label = self.figures, obs.label
        if label is None:
            return failures
        f.served[label] = f.served.get(label, 0) + 1
        checked = self.driver.tally.checked[CREDIT] - credit_before[0]
        failed = self.driver.tally.failed[CREDIT] - credit_before[1]
        f.credit_checked[label] = f.credit_checked.get(label, 0) + checked
        f.credit_failed[label] = f.credit_failed.get(label, 0) + failed
        if obs.credited:
            f.credited[label] = f.credited.get(label, 0) + 1
        served = self._served_by(obs)
        if served is not None:
            tally = self.driver.tally
            tally.checked[ROUTED_RANK_SERVED] += 1
            if served != label:
                tally.failed[ROUTED_RANK_SERVED] += 1
                return [*failures, (ROUTED_RANK_SERVED, (
                    f"request {obs.request}: the router routed it to {label} and credited {obs.router_tokens} tokens "
                    f"there, but {served}'s stream stored the prompt's pages ({label}'s holds "
                    f"{obs.stored_pages} of {self._want(obs)}); {obs.numbers()}"))]
        return failures

    def _want(self, obs: Any) -> int:
        return stored_pages(obs.n, obs.block_size, eagle=obs.engine_eagle)

    def _served_by(self, obs: Any) -> str | None:
        """The rank whose stream shows the prompt's pages once settled: the routed rank when its own
        does, else another rank of the same worker whose stream stored them during the request (it
        held fewer at the routing mark); None when no stream tells."""
        want = self._want(obs)
        if want == 0:
            return None
        if obs.stored_pages >= want:
            return obs.label
        worker = ranks.split_label(obs.label)[0]
        d = self.driver
        for lab in d.labels:
            if lab == obs.label or ranks.split_label(lab)[0] != worker or lab not in obs.engine_marks:
                continue
            before = d._held(d.engine_views, lab, obs.tokens, obs.engine_marks[lab], obs.engine_marks[lab], salt=obs.salt)[0]
            if d._held_now(lab, obs.tokens, obs.salt) >= want > before:
                return lab
        return None

    def cause(self, obs: Any) -> str | None:
        """``DP_RANK_UNPUBLISHED`` when the rank that served ``obs`` reused cached pages but its stream
        carried no batch since the example began (each example starts with every rank flushed, so
        whatever it reused it cached, and would have published, since); None otherwise (the driver
        names the cause as usual)."""
        if obs.label is None or not obs.engine_tokens or self.driver.engine_views.since_epoch(obs.label):
            return None
        return Cause.DP_RANK_UNPUBLISHED.name

    def invariants_json(self, base: dict[str, Any]) -> dict[str, Any]:
        """The tally's JSON with the per-rank split of the credit check."""
        out = dict(base)
        if CREDIT in out:
            out[CREDIT] = {**out[CREDIT], "by_rank": self.figures.by_rank()}
        return out


def machine_class(base: type[RuleBasedStateMachine], driver: Any) -> type[RuleBasedStateMachine]:
    """``base`` plus :func:`sticky_follow_up` (``--dp-size`` only)."""
    from kvalign.live.runs.fuzz.prompts import lengths, max_tokens

    b = driver.opts.page_size

    class DataParallelFuzz(base):  # type: ignore[misc, valid-type]
        @precondition(lambda self: bool(driver.history))
        @rule(of=st.integers(0, 63), seed=st.integers(0, 2**16), extra=st.sampled_from((0, 1, 2, b - 1, b, b + 1)),
              mt=max_tokens())
        def sticky_follow_up(self, of: int, seed: int, extra: int, mt: int) -> None:
            driver.run_step(sticky_step(driver, of, seed, extra, mt))

        @rule(seed=st.integers(0, 2**16), length=lengths(b).filter(lambda k: k > 2 * b + 1), mt=max_tokens())
        def every_rank(self, seed: int, length: int, mt: int) -> None:
            run_every_rank(driver, seed, length, mt)

    return DataParallelFuzz


def run_every_rank(driver: Any, seed: int, length: int, mt: int) -> None:
    """``every_rank``: on each rank in turn, a fresh prompt pinned there, then its follow-up there."""
    b = driver.opts.page_size
    for i, _label in enumerate(driver.labels):
        driver.run_step({"rule": "request", "prompt": {"kind": "fresh", "seed": seed + i, "length": length},
                         "max_tokens": mt, "pin": i})
        driver.run_step(sticky_step(driver, len(driver.history) - 1, seed + i, b + 1, 1))


def sticky_step(driver: Any, of: int, seed: int, extra: int, mt: int) -> dict[str, Any]:
    """A ``request`` step: the follow-up of history prompt ``of``, pinned to the rank that served it
    (unpinned when no live rank did); the step keeps the pin, so a replay sends it there too."""
    served = driver.served[of % len(driver.history)]
    step: dict[str, Any] = {"rule": "request", "prompt": {"kind": "follow_up", "of": of, "seed": seed, "extra": extra},
                            "max_tokens": mt}
    if served in driver.labels:
        step["pin"] = driver.labels.index(served)
    return step


def rank_samples(snap: Any, rank: int | None) -> Any:
    """``snap`` with only rank ``rank``'s samples of every metric that carries a ``dp_rank`` label.

    Every scheduler of a data-parallel worker exports SGLang's speculative-decoding metrics with its
    own ``dp_rank`` label, and ``spec_accept_length`` is a gauge: averaged over both ranks, an idle
    rank's stale reading stood in for the serving rank's (a generated run failed
    ``decode_keeps_speculating`` at 1.000 tokens per verify step, and its replay passed). So a
    speculation window reads only the serving rank's samples; a metric without ``dp_rank`` labels
    is read whole."""
    from kvalign.live.wire.metrics import MetricsSnapshot

    if rank is None:
        return snap
    ranked = {s.name for s in snap.samples if any(k == "dp_rank" for k, _v in s.labels)}
    keep = [s for s in snap.samples if s.name not in ranked or ("dp_rank", str(rank)) in s.labels]
    return MetricsSnapshot(keep, snap.types)
