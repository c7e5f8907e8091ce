"""One request's record: where it ran, what each view held for it at the routing mark, what came back.

Why its own part: the three-way check (:mod:`.invariants`) is only as good as the numbers it is
handed, and they all come from one moment — the marks of every view taken before the request is
sent. This mixin of :class:`~.driver.FuzzDriver` sends a request (pinned or routed), names the
source the router chose, reads each view at those marks (the prediction, what the hop delivered,
the engine's own stream; per tier with HiCache) into an :class:`~.invariants.Observation`, and
appends it to the example's history, which later prompts extend and the replay script records.
"""

from __future__ import annotations

from typing import Any

from kvalign.live.cluster import ranks
from kvalign.live.runs.fuzz.invariants import Observation, observation_json
from kvalign.live.runs.fuzz.prompts import Sent
from kvalign.live.runs.fuzz.views import DeliveredViews, WorkerViews
from kvalign.live.runs.fuzz import hicache as tiers_check
from kvalign.live.wire.client import Completion, SseError, complete_tokens
from kvalign.live.runs.fuzz.options import FuzzEnvironmentError


class Observing:
    """Per-request sending and recording (see the module docstring)."""

    @property
    def labels(self) -> list[str]:
        """The workers the router routes prefill to (and whose events it indexes): one per rank of a
        data-parallel worker (:mod:`kvalign.live.cluster.ranks`)."""
        return list(ranks.sources(self.cluster.plan))

    def _handle(self, label: str) -> Any:
        """The worker (its handle) a source label belongs to."""
        return self.cluster.workers[ranks.split_label(label)[0]]

    @property
    def prediction_views(self) -> WorkerViews | DeliveredViews:
        """The engine's batches the hop delivered; all of them with the gap check off."""
        return self.delivered_views if self.opts.gap_check else self.engine_views

    def engine_eagle(self, label: str) -> bool:
        return self._handle(label).spec.eagle

    def decode_label(self, label: str) -> str:
        return next(n for n, h in self.cluster.workers.items() if h.spec.role == "decode") if self.disagg else \
            ranks.split_label(label)[0]

    def _label_of(self, c: Completion) -> str | None:
        """The source the router chose: the worker ``prefill_worker_id`` names, at ``prefill_dp_rank``."""
        name = next((n for n, h in self.cluster.workers.items() if h.instance_id == c.prefill_worker_id), None)
        if name is None:
            return None
        n = self.cluster.plan.worker_ports[name].kv_ranks
        return ranks.source_label(name, c.prefill_dp_rank or 0, n) if n > 1 else name

    def _send(self, tokens: list[int], max_tokens: int, pin: str | None = None, salt: str | None = None) -> Completion:
        """``pin``: the source label the request must run on (a worker, and its rank when it has several)."""
        instance = None if pin is None else self._handle(pin).instance_id
        pins: dict[str, Any] = {"prefill_pin": instance} if self.disagg else {"pin": instance}
        if pin is not None and ranks.split_label(pin)[1] is not None:
            pins["dp_rank"] = ranks.split_label(pin)[1]
        try:
            url = self.cluster.frontend_url if self.replicas is None else self.replicas.next_url()
            return complete_tokens(url, self.cluster.model, tokens, max_tokens=max_tokens, cache_salt=salt, **pins)
        except (SseError, OSError) as exc:
            raise FuzzEnvironmentError(f"request of {len(tokens)} tokens failed: {exc}") from None

    def _held(self, views: WorkerViews | DeliveredViews, label: str, tokens: list[int], lo: int, hi: int | None = None,
              salt: str | None = None) -> list[int]:
        return views.held(label, tokens, eagle=self.engine_eagle(label), lo=lo, hi=hi, namespace=salt)

    def _held_now(self, label: str, tokens: list[int], salt: str | None = None) -> int:
        """The engine view's leading pages of ``tokens`` on ``label`` now."""
        return self._held(self.engine_views, label, tokens, self.engine_views.mark(label), salt=salt)[0]

    def _marks(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(prediction, delivered, engine) marks now."""
        return self.prediction_views.marks(), self.delivered_views.marks(), self.engine_views.marks()

    def _best(self, tokens: list[int], marks: dict[str, int], salt: str | None) -> str | None:
        held = {lab: self._held(self.prediction_views, lab, tokens, marks[lab], salt=salt)[0] for lab in self.labels}
        if self.opts.hicache:  # the router weighs a host block by its host_cache_hit_weight
            held = {lab: tiers_check.weighted(self.prediction_views.residency(
                lab, tokens, eagle=self.engine_eagle(lab), lo=marks[lab], namespace=salt)[0], self.host_weight)
                for lab in self.labels}
        top = max(held.values(), default=0)
        leaders = [lab for lab, h in held.items() if h == top]
        return leaders[0] if top > 0 and len(leaders) == 1 else None

    def _observation(self, tokens: list[int], c: Completion, label: str | None, marks: tuple, *, concurrent: bool,
                     engine_tokens: int | None, surface: str, best: str | None = None,
                     salt: str | None = None) -> Observation:
        pred_m, deliv_m, eng_m = marks
        predicted = engine_held = 0
        faulted = False
        if label is not None:
            predicted = self._held(self.prediction_views, label, tokens, pred_m[label], salt=salt)[0]
            engine_held = self._held(self.engine_views, label, tokens, eng_m[label], salt=salt)[0]
            delivered = self._held(self.delivered_views, label, tokens, deliv_m[label], salt=salt)[0]
            faulted = delivered != engine_held and any(d.label == label for d in self.hop.dropped)
        self.requests += 1
        kind = tiers_check.TierObservation if self.opts.hicache else Observation
        return kind(self.requests, tokens, c, label, concurrent, self.opts.page_size,
                           self.engine_eagle(label) if label else True, predicted, engine_held, engine_tokens,
                           surface, faulted, best, engine_mark=eng_m.get(label, 0) if label else 0, salt=salt,
                           engine_marks=dict(eng_m), vllm=self.opts.engine == "vllm-cpu")

    def _record(self, obs: Observation) -> None:
        self.history.append(Sent(tuple(obs.tokens), tuple(obs.completion.completion_token_ids)))
        self.served.append(obs.label)
        self.observed.append(observation_json(obs))

    def _tiers_now(self, *, required: bool) -> tuple[float, dict[str, dict[str, float] | None]]:
        """HiCache: the router's raw credit counter and each publishing worker's per-tier reuse, now."""
        assert self.engine_tiers is not None
        return self.router_credit.now(required=required), self.engine_tiers.snapshots()

    def _annotate_tiers(self, obs: Observation, before: tuple[float, dict[str, dict[str, float] | None]], marks: tuple,
                        salt: str | None) -> None:
        """Fill a HiCache request's per-tier fields: residency in both views at the routing mark, the
        router's raw credit (its counter's delta) and the engine's split (its counter's delta)."""
        assert isinstance(obs, tiers_check.TierObservation)
        raw, engine = self._tiers_now(required=True)
        obs.router_raw, obs.weight = raw - before[0], self.host_weight
        if obs.label is None:
            return
        eagle = self.engine_eagle(obs.label)
        obs.residency = self.engine_views.residency(obs.label, obs.tokens, eagle=eagle, lo=marks[2][obs.label],
                                                    namespace=salt)[0]
        obs.router_view = self.delivered_views.residency(obs.label, obs.tokens, eagle=eagle, lo=marks[1][obs.label],
                                                         namespace=salt)[0]
        if obs.router_view != obs.residency and any(d.label == obs.label for d in self.hop.dropped):
            # the hop lost a batch of this worker's on purpose: with HiCache a device store and its host
            # copy travel in separate batches, so the router can hold every page in the other tier only
            obs.hop_faulted = True
        assert self.engine_tiers is not None
        obs.engine_split = self.engine_tiers.split(obs.label, before[1].get(obs.label), engine.get(obs.label),
                                                   obs.engine_tokens)
        if self.opts.hicache is not None and self.opts.hicache.storage:
            obs.storage = self.engine_tiers.storage(obs.label, before[1].get(obs.label), engine.get(obs.label),
                                                    obs.engine_tokens)
