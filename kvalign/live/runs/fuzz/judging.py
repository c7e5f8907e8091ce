"""Judging a recorded request, naming the cause of a failure, and the run's figures.

Why its own part: a request's verdict is the invariants (:mod:`.invariants`), the per-tier rules
with HiCache (:mod:`.hicache`) and the per-rank split with ``--dp-size`` (:mod:`.dp_ranks`), and a
failure must come out with its cause and evidence — the tenant salt the hop dropped, the engine's
own recorded stream, or ``kvalign diagnose`` on the router-side capture — however it was found.
This mixin of :class:`~.driver.FuzzDriver` does that, and gives the counts and per-invariant
tallies the run's JSON reports (:func:`~.machine.run_fuzz`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvalign.model.causes import Cause
from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvalign.live.runs.fuzz.invariants import InvariantFailed, Observation, evaluate, failure_numbers
from kvalign.live.runs.fuzz.recorded import record_engine_stream, engine_cause
from kvalign.live.runs.fuzz.speculation import Judged
from kvalign.live.runs.fuzz.views import WorkerViews
from kvalign.live.runs.fuzz.vllm_hashes import bytes_hash_stores, bytes_hashes_cause, undecoded_payloads
from kvalign.live.cluster import ranks
from kvalign.live.runs.fuzz import hicache as tiers_check
from kvalign.live.runs.fuzz import hicache_rules


class Judging:
    """Verdicts, causes and figures (see the module docstring)."""

    def _check(self, obs: Observation) -> None:
        if self.credit_error is not None:
            self.credit_error.add(obs.router_tokens, obs.engine_tokens, hop_faulted=obs.hop_faulted)
        router_judged = self.opts.router_mode == "events"
        credit_before = (self.tally.checked["router_credits_engine_reuse"], self.tally.failed["router_credits_engine_reuse"])
        failures = evaluate(obs, self.tally, router_judged=router_judged)
        if self.dp is not None:
            failures = self.dp.judge(obs, failures, credit_before)
        if isinstance(obs, tiers_check.TierObservation):
            if router_judged:
                failures += tiers_check.evaluate_tiers(obs, self.tally)
                failures.sort(key=lambda f: tiers_check.EVALUATION_ORDER.index(f[0]))
            hicache_rules.record(self, obs)
        if failures:
            name, detail = failures[0]
            names = [n for n, _ in failures]
            hicache_cause = tiers_check.cause(obs)
            rank_cause = None if self.dp is None else self.dp.cause(obs)
            cause, evidence = (hicache_cause or rank_cause, None) if hicache_cause or rank_cause else self.cause(obs, names)
            if cause == Cause.VLLM_BYTES_HASHES_DROPPED.name and "router_credits_engine_reuse" in names:
                # kvalign's engine view decodes hashes as the relay does and is as empty: the failure a user
                # meets is the router's credit, with engine_matches_index failing beside it
                name, detail = next(f for f in failures if f[0] == "router_credits_engine_reuse")
            numbers = {**failure_numbers(obs), **({"rank": obs.label} if self.dp is not None else {})}
            raise InvariantFailed(name, detail, cause=cause, worker=obs.label, request=obs.request,
                                  numbers=numbers, failing=names, evidence=evidence)

    def cause(self, obs: Observation, failing: list[str]) -> tuple[str, dict[str, Any] | None]:
        """Why a request failed, and the evidence: on vLLM workers first ``VLLM_BYTES_HASHES_DROPPED`` where the
        worker publishes bytes hashes the relay dropped (:mod:`.vllm_hashes`: its events are unreadable to kvalign's
        views too, which would otherwise name the empty stream); the tenant cause when the hop delivered a stored
        block without the ``cache_salt`` the engine published it with; the engine's own events when
        the engine reused pages its stream did not hold in the prompt's chain at the routing mark
        (:func:`.recorded.engine_cause`, from the stream recorded for the failure); else ``kvalign
        diagnose``'s cause for the prompt on the worker's router-side capture."""
        label = obs.label
        if label is not None and self.opts.engine == "vllm-cpu":
            found = self._bytes_hashes(obs, label)
            if found is not None:
                return found
        if label is not None and self._salt_lost(label):
            return Cause.TENANTS_SHARE_KEYS.name, None
        if label is not None and "engine_matches_index" in failing and obs.engine_tokens is not None:
            batches, start = self.engine_views.batches(label), self.engine_views.epoch.get(label, 0)
            if start and any(isinstance(ev, AllBlocksCleared) for ev in batches[start - 1].events):
                start -= 1  # the example's flush: the recorded stream starts with the clear, as a cache that was emptied
            path = record_engine_stream(Path(self.cluster.plan.run_dir) / "failures", obs.request, batches[start:],
                                        obs.tokens)
            found = engine_cause(path, obs.tokens, obs.engine_tokens, self.opts.page_size, eagle=obs.engine_eagle,
                                 routed_at=obs.engine_mark - start, salt=obs.salt)
            if found is not None:
                return found
        d = self.diagnose(label, obs.tokens)
        return ("none" if d is None or d.cause is None else d.cause.name), None

    def _bytes_hashes(self, obs: Observation, label: str) -> tuple[str, dict[str, Any]] | None:
        """``VLLM_BYTES_HASHES_DROPPED`` from the worker's environment, its stream and the relay's (:mod:`.vllm_hashes`)."""
        relay_pages = sum(len(ev.block_hashes) for b in self.router_views.since_epoch(label) for ev in b.events
                          if isinstance(ev, BlockStored))
        wire = bytes_hash_stores(undecoded_payloads(self.cluster.capture.capture_path(label)))
        return bytes_hashes_cause(environ=self.cluster.group.environ(ranks.split_label(label)[0]),
                                  engine_tokens=obs.engine_tokens, credited=obs.credited, relay_pages=relay_pages,
                                  wire=wire)

    def _salt_lost(self, label: str) -> bool:
        def salts(views: WorkerViews) -> dict[int | None, list[str | None]]:
            return {self.hop.original_seq(label, b.seq): [e.cache_salt for e in b.events if isinstance(e, BlockStored)]
                    for b in views.since_epoch(label)}

        engine, router = salts(self.engine_views), salts(self.router_views)
        return any(engine.get(seq) not in (None, got) for seq, got in router.items())

    def diagnose(self, label: str | None, tokens: list[int]) -> Any:
        from kvalign.streams.diagnose import RouterSettings, diagnose

        if label is None:
            return None
        path = self.cluster.router_capture.capture_path(label)
        if path is None or not Path(path).exists():
            return None
        eagle = "on" if self._handle(label).enable_eagle else "off"
        try:
            return diagnose(path, tokens, RouterSettings(block_size=self.opts.page_size, eagle=eagle))
        except Exception:  # noqa: BLE001 - a failure report must still come out, without a cause
            return None

    def _judged(self, judged: Judged) -> None:
        """A speculation window's figure, into its requests' records and the progress log."""
        tpv = judged.window.tokens_per_verify
        for rec in self.observed:
            if rec["request"] in judged.requests:
                rec["tokens_per_verify"], rec["speculation_window"] = tpv, list(judged.requests)
        self.progress(f"speculation, {judged.describe()}")

    def finish_counts(self) -> dict[str, int]:
        """The counts, with evictions read off the engine's own stream (pages removed)."""
        removed = sum(1 for c in self.cluster.capture.snapshot() for ev in c.batch.events if isinstance(ev, BlockRemoved))
        tiered = tiers_check.tier_counts({lab: self.engine_views.batches(lab) for lab in self.labels},
                                         self.opts.page_size) if self.opts.hicache else {}
        by_rank = {} if self.dp is None else {"requests_by_rank": self.dp.figures.requests_by_rank()}
        return {**self.counts, "evictions": removed, **tiered, **by_rank}

    def invariants_json(self) -> dict[str, Any]:
        """Each invariant's checked / failed counts (with the per-rank split on data-parallel workers)."""
        return self.tally.as_json() if self.dp is None else self.dp.invariants_json(self.tally.as_json())
