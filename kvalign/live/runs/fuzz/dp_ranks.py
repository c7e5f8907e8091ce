"""The fuzz on data-parallel workers (``--dp-size N``): one view, one hop, one verdict per rank.

Each rank of a ``--dp-size N`` worker is a KV cache of its own with a KV-event stream of its own
(SGLang's port + rank), and Dynamo routes each request to one ``(instance, dp_rank)``. So the fuzz
treats every rank as a source (:mod:`kvalign.live.cluster.ranks`): its own lossy hop (Dynamo's
relay for rank r subscribes to rank r's hop, :func:`relay_subscriptions`), its own engine and
router views, and the worker a request ran on is the ``(prefill_worker_id, prefill_dp_rank)`` the
router reports. The invariants then hold per rank: the router's credit equals the engine's reuse on
the rank that served the request, and its prediction is that rank's view. This module adds:

* ``routed_rank_served``: the rank the router routed to (and credited) is the rank that served the
  request: once settled, the prompt's pages are on the routed rank's own stream; judged only when
  some rank's stream shows them (a request whose pages no stream shows is ``engine_matches_index``'s);
* per-rank figures: ``counts.requests_by_rank`` and, per rank, how often
  ``router_credits_engine_reuse`` was checked and failed and how many requests the router credited
  (which it can only do for a rank whose events it indexed);
* the cause of a failure on a rank whose stream never carried a batch since the cluster started
  (not even the flush every example begins with): ``DP_RANK_UNPUBLISHED``.

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

from kvalign.live.cluster import ranks
from kvalign.live.cluster.ports import LOOPBACK
from kvalign.model.causes import Cause

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
    rank_checked: int = 0
    rank_failed: int = 0

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
        served = self._served_elsewhere(obs)
        if served is not None:
            f.rank_checked += 1
            if served != label:
                f.rank_failed += 1
                return [*failures, (ROUTED_RANK_SERVED, (
                    f"request {obs.request}: the router routed it to {label} and credited {obs.router_tokens} tokens "
                    f"there, but {served}'s stream stored the prompt's pages ({label}'s holds "
                    f"{obs.stored_pages} of {self._want(obs)}); {obs.numbers()}"))]
        return failures

    def _want(self, obs: Any) -> int:
        return (obs.n - int(obs.engine_eagle)) // obs.block_size

    def _served_elsewhere(self, obs: Any) -> str | None:
        """The rank whose stream shows the prompt's pages once settled: the routed rank when its own
        does, else another rank of the same worker that does; None when no stream shows them."""
        want = self._want(obs)
        if want == 0:
            return None
        if obs.stored_pages >= want:
            return obs.label
        worker = ranks.split_label(obs.label)[0]
        for lab in self.driver.labels:
            if lab != obs.label and ranks.split_label(lab)[0] == worker and self.driver._held_now(lab, obs.tokens, obs.salt) >= want:
                return lab
        return None

    def cause(self, label: str | None) -> str | None:
        """``DP_RANK_UNPUBLISHED`` for a rank whose stream carried no batch since the example began,
        though it served requests and was flushed; None otherwise (the driver names the cause as
        usual). Since the example, not ever: a cluster shared by several tests (or examples) keeps
        what the rank published before the fault was armed."""
        if label is None or self.driver.engine_views.since_epoch(label):
            return None
        return Cause.DP_RANK_UNPUBLISHED.name

    def invariants_json(self, base: dict[str, Any]) -> dict[str, Any]:
        """The tally's JSON with ``routed_rank_served`` and the per-rank split of the credit check."""
        out = dict(base)
        if CREDIT in out:
            out[CREDIT] = {**out[CREDIT], "by_rank": self.figures.by_rank()}
        out[ROUTED_RANK_SERVED] = {"checked": self.figures.rank_checked, "failed": self.figures.rank_failed}
        return out
