"""When the fuzz may take its next prediction: settling on a quiet, caught-up cluster (bounded).

Why its own part: a prediction taken while the router side is still behind the engine's stream
would report a disagreement that is only latency, and one taken after waiting for the outcome
would hide a real one. This mixin of :class:`~.driver.FuzzDriver` holds the only waits of a run:
before a request (quiet for ``quiet_s``, every batch delivered, the router's index applied every
event), after an answer (the request's own stores seen), and after a flush. A wait that reaches
``settle_timeout_s`` is counted in ``unsettled_waits``, never retried to make a result go away.

It reads the driver's ``cluster``, ``hop``, ``opts``, ``metrics``, ``replicas``, ``engine_views``,
``labels`` and ``progress``, and keeps ``_settled_at``, ``_lag_base``, ``_applied_base`` and ``_corrupted``
(the workers whose stream no longer shows what they hold).
"""

from __future__ import annotations

import time

from kvalign.live.cluster.control import ControlError, clear_kv_blocks
from kvalign.live.cluster.topology import COMPONENT
from kvalign.live.runs.fuzz.stores import cached_tokens_after, stored_page_range, stored_pages, stores_seen
from kvalign.live.runs.fuzz.surfaces import applied_units
from kvalign.live.runs.fuzz.options import FuzzEnvironmentError
from kvalign.live.runs.fuzz.prompts import new_tokens

#: the one-token prompt that makes an idle vLLM worker publish its queued reset: clear of every rule's seeds
VLLM_STEP_SEED = 2**40 - 1


class Settling:
    """The driver's waits (see the module docstring)."""

    def _behind(self) -> dict[str, int]:
        """Per worker, engine batches the router side has not received yet (beyond the batches the
        hop lost on purpose, and beyond the example's baseline)."""
        lost = self.hop.lost_downstream
        return {lab: self.cluster.capture.count(lab) - self.cluster.router_capture.count(lab) - lost.get(lab, 0)
                - self._lag_base.get(lab, 0) for lab in self.labels}

    def _components(self) -> list[str]:
        return sorted({COMPONENT[self._handle(lab).spec.role] for lab in self.labels})

    def _delivered_events(self) -> int:
        """KV events the router side received from the publishing workers (what the relay got), in the
        frontend's ``kv_cache_events_applied`` unit (:func:`.surfaces.applied_units`)."""
        labels = set(self.labels)
        return sum(applied_units(c.batch.events) for c in self.cluster.router_capture.snapshot() if c.label in labels)

    def _applied_behind(self) -> float:
        """Events the relay received that the router's index has not applied yet (0 without the counter)."""
        if self.replicas is not None and self.replicas.event_plane_down:
            return 0.0
        delivered = self._delivered_events()
        others = 0.0 if self.replicas is None else self.replicas.applied_behind(delivered, self._components())
        if self._applied_base is None:
            return others
        applied = self.metrics.events_applied(self._components())
        return max(others, 0.0 if applied is None else delivered - (applied - self._applied_base))

    def _rebase_applied(self) -> None:
        """Count from now: what the router applied before (an earlier user of the cluster, batches the
        capture joined too late for) or will never apply (a restarted worker's relay) is not waited on."""
        if self.opts.router_mode == "approx":  # the router consumes no KV events: nothing to wait for
            return
        applied = self.metrics.events_applied(self._components())
        self._applied_base = None if applied is None else applied - self._delivered_events()
        if self.replicas is not None:
            self.replicas.rebase_applied(self._delivered_events(), self._components())

    def _settle(self, *, after_request: bool = False) -> bool:
        """Wait until the router side has every batch the engine published (but those the hop lost
        on purpose) and no capture received a batch for ``quiet_s`` (bounded). After a request the
        quiet time counts from now (its events may not be out yet); before one it counts from the
        latest batch's arrival, so a cluster that the previous step already settled costs no wait.
        Quiet alone is not enough on a loaded machine: the router side (Dynamo's relay, and kvalign's
        capture of it) was seen half a second behind the engine's stream after a flush, and the
        router's index behind its relay (a CI run: credit 0 for 3 pages the relay had, the replay
        credited them), so it also waits until the frontend's index applied every event the relay
        received (:meth:`MetricReader.events_applied`). A shortfall still there at the bound is
        counted as unsettled and not waited on again."""
        caps = (self.cluster.capture, self.cluster.router_capture)
        if not after_request and self._settled_at == tuple(c.count() for c in caps):
            return True  # the last request settled on its stores being seen, and nothing arrived since
        deadline = time.monotonic() + self.opts.settle_timeout_s
        arrivals = [t for t in (c.last_received() for c in caps) if t is not None]
        since = time.monotonic() if after_request else max(arrivals, default=0.0)
        last = tuple(c.count() for c in caps)
        while time.monotonic() < deadline:
            now = tuple(c.count() for c in caps)
            if now != last:
                last, since = now, time.monotonic()
            elif (time.monotonic() - since >= self.opts.quiet_s and all(v <= 0 for v in self._behind().values())
                  and self._applied_behind() <= 0):
                return True
            time.sleep(0.02)
        self._unsettled(f"still not quiet after {self.opts.settle_timeout_s:g}s (behind {self._behind()})")
        return False

    def _unsettled(self, why: str) -> None:
        """A settle that reached its bound: counted, and an applied-events shortfall not waited on again."""
        self.unsettled += 1
        self.progress(f"settle: {why}; counted in unsettled_waits")
        behind = self._applied_behind()
        if behind > 0:
            self.notes.append(f"the router's index had applied {behind:g} fewer KV events than its "
                              f"relay received after {self.opts.settle_timeout_s:g}s; counted from there")
            self._rebase_applied()

    def _awaits_stores(self, label: str | None, dropped_before: int) -> bool:
        """Whether the request answered by ``label`` is settled on its own stores (:meth:`_settle_stores`).
        Not when the stream will never show them (a loss or fault on purpose: this request's batch lost
        unpublished, a worker whose stream such a loss or fault broke this example, a silenced rank), or
        when HiCache's counters are read next and move on their own time: a quiet window then."""
        return not (label is None or self._lost_unpublished(dropped_before) or label in self._corrupted
                    or label in self.hop.silenced or self.opts.hicache)

    def _lost_unpublished(self, dropped_before: int) -> set[str]:
        """The workers whose batch the hop lost unpublished since its ``dropped_before``-th loss."""
        return {d.label for d in self.hop.dropped[dropped_before:] if d.unpublished}

    def _broken_by_losses(self, dropped_before: int) -> None:
        """After a request: a worker whose batch the hop lost unpublished holds pages its stream never
        showed, so a later request extending them (the loss's follow-up) cannot be settled on its stores
        (the stream cannot account for their leading pages): it waited out the whole bound (8 s of the
        12.1 s ``test_a_batch_lost_unpublished_fails_engine_matches_index``). Counted as broken, like a
        harmful publisher fault, until the example ends or the worker restarts."""
        self._corrupted.update(self._lost_unpublished(dropped_before))

    def _settle_stores(self, label: str, prompt: list[int], output: list[int], mark: int, salt: str | None,
                       answered: float, dropped_before: int) -> bool:
        """After an answer: wait (bounded) until ``label``'s own stream shows every page the request
        stored (:mod:`.stores`: held at the routing ``mark`` or stored since) and the router side has
        caught up with it (every batch, and the frontend's index has applied every event), with no
        quiet window. Where SGLang may or may not have stored one more page (the last generated
        token's KV), and the prompt's own stores already account for the rest, that page is waited
        for until ``quiet_s`` after the answer.

        Waiting on the stores themselves is what a quiet window only guessed at: a prefill worker
        publishes its stores when the request is done on *its* side, which on a loaded machine came
        more than 0.4 s after the decode worker's answer, so the next request found pages the engine
        held and neither view had yet (the engine reused 288 tokens that kvalign's engine view said
        were not there). A batch that comes after this point anyway (an eviction published late)
        makes the next request's settle wait for quiet again.

        A batch the hop loses unpublished (a script's control: no view will ever show it) may reach
        the hop only after the answer: once :attr:`hop.dropped` shows it (any since ``dropped_before``),
        the wait is for quiet instead, as when the loss was seen at the answer, rather than for pages
        that cannot come (a race guarded, not seen; the measured 8 s was the follow-up's wait,
        :meth:`_broken_by_losses`)."""
        b, eagle, decodes = self.opts.page_size, self.engine_eagle(label), not self.disagg
        cached = cached_tokens_after(prompt, output, decodes=decodes)
        lo, hi = stored_page_range(len(prompt), len(output), b, eagle=eagle, decodes=decodes)
        maybe_more = hi > lo and lo <= stored_pages(len(prompt), b, eagle=eagle)  # no finish batch was needed for lo
        held = self._held(self.engine_views, label, cached, mark, salt=salt)[0]
        since = mark - self.engine_views.epoch.get(label, 0)
        deadline = time.monotonic() + self.opts.settle_timeout_s
        while True:
            if self._lost_unpublished(dropped_before):
                return self._settle(after_request=True)
            seen = stores_seen(self.engine_views.since_epoch(label), since, cached, held, b, eagle=eagle, namespace=salt)
            enough = seen >= hi or (seen >= lo and (not maybe_more or time.monotonic() - answered >= self.opts.quiet_s))
            if enough and all(v <= 0 for v in self._behind().values()) and self._applied_behind() <= 0:
                self._settled_at = (self.cluster.capture.count(), self.cluster.router_capture.count())
                return True
            if time.monotonic() > deadline:
                self._unsettled(f"{label}'s stream shows {seen} of the {lo} pages the request stored after "
                                f"{self.opts.settle_timeout_s:g}s (router side behind {self._behind()})")
                return False
            time.sleep(0.01)

    def _clear(self, labels: list[str]) -> None:
        self._settled_at = None
        before = {lab: self.engine_views.mark(lab) for lab in labels}
        groups: dict[str, list[int]] = {}
        for lab in labels:
            ids = groups.setdefault(COMPONENT[self._handle(lab).spec.role], [])
            if self._handle(lab).instance_id not in ids:  # a data-parallel worker's ranks are flushed at once
                ids.append(self._handle(lab).instance_id)
        try:
            for component, ids in groups.items():
                clear_kv_blocks(self.cluster.plan, component, ids)
        except ControlError as exc:
            raise FuzzEnvironmentError(str(exc)) from None
        answering = [lab for lab in labels if lab not in self.hop.silenced]  # a silenced rank's clear reaches no one
        if self.opts.engine == "vllm-cpu":
            self._step_vllm(answering)
        if not self.cluster.capture.wait_for(
                lambda _snap: all(self.engine_views.mark(lab) > before[lab] for lab in answering), self.opts.settle_timeout_s):
            raise FuzzEnvironmentError(f"no AllBlocksCleared from {answering} after clear_kv_blocks")
        self._settle()

    def _step_vllm(self, labels: list[str]) -> None:
        """vLLM queues its ``AllBlocksCleared`` (``block_pool.py:863``) and publishes queued events only
        after a model step (``Scheduler.update_from_output``, ``scheduler.py:2371-2385``): an idle
        worker publishes a reset with its next request. A one-token request pinned to each cleared
        worker (two tokens with its answer: no whole block to store) makes that step now. Until then
        the router still credits the cleared blocks (kvalign's views, which wait for the event, too)."""
        for lab in labels:
            self._send(new_tokens(VLLM_STEP_SEED, 1), 1, pin=lab)
