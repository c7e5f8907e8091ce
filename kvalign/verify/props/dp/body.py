"""The ``dp`` property: data-parallel ranks, on the real code of both sides.

Under data parallelism one worker holds several KV caches, one per rank, and the router indexes and
routes by ``(worker, dp_rank)``. Upstream, this is where routing went cache-blind most often since
the releases kvalign first covered: SGLang published only rank 0's events (sgl-project/sglang
#16030, #16412), Dynamo registered only rank 0 for pure DP (ai-dynamo/dynamo #14258) and routed
to ranks whose events it never indexed (#5097, #5108, #5589, #12186, #5873).

One row per layout (``pure-dp2``, ``pure-dp4``, ``dp-attn2``, ``dp-attn4``:
:data:`~kvalign.oracles.dp_sglang.DP_LAYOUTS`). Each starts the worker's schedulers with SGLang's
own placement and publishers (:mod:`kvalign.oracles.dp_sglang`) and ``dynamo.sglang``'s own
registration and relays with a real router (:mod:`kvalign.oracles.dp_dynamo`). Each generated
example caches prompts on chosen ranks (SGLang's real radix cache of that rank's scheduler,
published by its own publisher), waits until every publishing rank's stream is indexed, then, for
every prompt:

* **per rank**: the router's overlap on ``(worker, r)`` (``get_overlap_scores``) == the pages rank
  r's cache holds (``match_prefix``), for every rank SGLang runs: a block stored by rank r is
  credited to rank r, and only to it;
* **routing**: the request ``KvRouter.generate`` sends carries ``routing.dp_rank = r``, the rank
  its answer reports, with rank r's own overlap as its credit (``kv_hit_rate``); and r is the
  rank that holds the most pages when one rank does.

A divergence is named from what each side did, not from which fault was injected: a scheduler
that is no publisher (:attr:`Scheduler.publishes`), a registered rank the relays never subscribed
to, batches on rank r's port that carry another ``attn_dp_rank`` (a tap on SGLang's wire), a rank
the card does not register. The row's ``detail`` lists those facts for an aligned row too.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
from hypothesis import strategies as st

from kvalign.model.causes import Cause
from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.router_path import POLL_FIRST_S
from kvalign.oracles.dp_sglang import (DP_LAYOUTS, SGLANG_FAULTS, DpEngine, DpLayout, Scheduler, launch, sentinel_page,
                                       sentinel_tokens)
from kvalign.verify.engine.properties import Mismatch

#: The page size of the DP rows unless ``check --page-size`` pins one (the worker is launched with it).
DP_PAGE_SIZE = 4
#: How long one rank's sentinel page may take to show up in the router's answer.
BARRIER_TIMEOUT_S = 4.0
#: How long a rank that missed the barrier, and that nothing on either side explains, is waited on once more
#: before a row names its events dropped: a relay on a loaded machine can take longer than the barrier
#: (three ``check`` workers at load 12 turned a 4 s barrier into a false EVENTS_DROPPED on pure-dp4).
REVIVE_TIMEOUT_S = 30.0
#: Token ids of each example live in their own window (the router's index is never emptied).
TOKEN_SPACE = 16
DP_FAULTS = ("rank0-only", "tag-rank0", "unsubscribed", "pin-rank0")


@dataclass(frozen=True)
class DpScenario:
    """Prompts cached on chosen ranks of one worker, then queried (the stored ones and a few others)."""

    stores: list[tuple[int, list[int]]]
    queries: list[list[int]] = field(default_factory=list)


@st.composite
def dp_scenarios(draw: st.DrawFn, *, ranks: int, page_size: int) -> DpScenario:
    """Prompts over a 3-token vocabulary (so ranks often share a prefix), 1 to 4 pages and a bit long,
    stored on any rank, the same prompt on several ranks included."""
    prompt = st.lists(st.integers(0, 2), min_size=page_size, max_size=4 * page_size + 1)
    stores = draw(st.lists(st.tuples(st.integers(0, ranks - 1), prompt), min_size=1, max_size=4))
    return DpScenario(stores, draw(st.lists(prompt, max_size=2)))


class WireTags:
    """A subscriber beside Dynamo's relay on each rank's SGLang port: the ``attn_dp_rank`` its batches carry."""

    def __init__(self, endpoints: dict[int, str]) -> None:
        self._ctx = zmq.Context()
        self._subs: dict[int, Any] = {}
        self.tags: dict[int, set[int | None]] = {r: set() for r in endpoints}
        for rank, endpoint in endpoints.items():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            self._subs[rank] = sub

    def drain(self) -> None:
        for rank, sub in self._subs.items():
            while sub.poll(0):
                frames = sub.recv_multipart()
                try:
                    batch = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
                except Exception:  # not a batch: nothing to attribute
                    continue
                if isinstance(batch, list) and len(batch) >= 2:
                    self.tags[rank].add(batch[2] if len(batch) > 2 else None)

    def close(self) -> None:
        for sub in self._subs.values():
            sub.close(linger=0)
        self._ctx.term()


class DpRig:
    """One layout's worker: SGLang's schedulers, ``dynamo.sglang``'s registration, relays and a router."""

    def __init__(self, path: Any, layout: DpLayout, *, page_size: int, fault: str | None = None,
                 barrier_timeout_s: float = BARRIER_TIMEOUT_S, revive_timeout_s: float = REVIVE_TIMEOUT_S) -> None:
        from kvalign.oracles.dp_dynamo import DpWorker

        if fault is not None and fault not in DP_FAULTS:
            raise ValueError(f"unknown DP fault {fault!r}; expected one of {DP_FAULTS}")
        self.layout, self.page_size, self.fault = layout, page_size, fault
        self.barrier_timeout_s, self.revive_timeout_s = barrier_timeout_s, revive_timeout_s
        engine_side = fault in SGLANG_FAULTS
        self.engine: DpEngine = launch(layout, page_size=page_size, fault=fault if engine_side else None)
        try:
            self.worker = DpWorker(path, self.engine, fault=None if engine_side else fault)
        except BaseException:
            self.engine.close()
            raise
        self.ranks: dict[int, Scheduler] = self.engine.by_rank()
        self.tap = WireTags({r: f"tcp://127.0.0.1:{self.engine.base_port + r}" for r in self.ranks})
        self.dead: set[int] = set()  # ranks whose sentinel missed the barrier (not waited on again by it)
        self.dropped: set[int] = set()  # dead ranks whose sentinel missed the longer wait too (:meth:`revive`)
        self._sentinels = itertools.count(1)
        self._space = 0

    def token_space(self) -> int:
        self._space += 1
        return self._space * TOKEN_SPACE

    def settle(self) -> None:
        """Publish the caches' pending events on every rank and wait until each publishing rank's
        sentinel page, published after them on the same stream, is credited to that rank."""
        pending = {}
        for rank, s in self.ranks.items():
            if not s.publishes or rank in self.dead:
                s.publish()
                continue
            k = next(self._sentinels)
            pending[rank] = (k, sentinel_tokens(k, self.page_size))
            s.publish([sentinel_page(k, self.page_size)])
        self.dead.update(self._await_credit(pending, self.barrier_timeout_s))
        self.tap.drain()

    def revive(self, rank: int) -> bool:
        """Whether ``rank``, dead by the barrier, was only slow: its stream credits a fresh sentinel within
        :data:`REVIVE_TIMEOUT_S`. Everything it published before is then indexed too (one ordered stream).

        Asked only where the router credits ``rank`` less than its cache holds and nothing on either side
        explains it (the cause would be the residual EVENTS_DROPPED): a rank that publishes nothing, is not
        subscribed to, or whose batches carry another rank's tag is named at once, as a control needs. A rank
        the longer wait did not revive is :attr:`dropped`, never waited on again: a search shrinking a real
        finding pays the wait once."""
        if rank not in self.dead or rank in self.dropped or self.why_uncredited(rank)[0] is not Cause.EVENTS_DROPPED:
            return False
        k = next(self._sentinels)
        self.ranks[rank].publish([sentinel_page(k, self.page_size)])
        if self._await_credit({rank: (k, sentinel_tokens(k, self.page_size))}, self.revive_timeout_s):
            self.dropped.add(rank)
            return False
        self.dead.discard(rank)
        return True

    def _await_credit(self, pending: dict[int, tuple[int, list[int]]], timeout_s: float) -> dict[int, tuple[int, list[int]]]:
        """Wait until the router credits each rank's sentinel (``pending``: rank -> its number and tokens), at
        most ``timeout_s``; what is still pending then."""
        pending = dict(pending)
        deadline, sent_at, pause = time.monotonic() + timeout_s, time.monotonic(), POLL_FIRST_S
        while pending and time.monotonic() < deadline:
            time.sleep(pause)  # from 1 ms up: a sentinel on loopback is credited within milliseconds
            pause = min(2 * pause, 0.01)
            if time.monotonic() - sent_at > 0.5:  # re-send: the first ones may precede the relay's subscription
                for rank, (k, _) in pending.items():
                    self.ranks[rank].publish([sentinel_page(k, self.page_size)])
                sent_at = time.monotonic()
            for rank, (_k, tokens) in list(pending.items()):
                if self.worker.scores(tokens).get(rank, 0) >= 1:
                    del pending[rank]
        return pending

    def facts(self) -> str:
        """What each side decided: every scheduler's publisher rank and port, the tags on the wire, the
        ranks the card registers and the relays subscribe to."""
        schedulers = []
        for s in self.engine.schedulers:
            src = s.source
            where = f"rank {s.publisher_rank} on {src['endpoint']}" if src else "no publisher"
            schedulers.append(f"tp{s.tp_rank}/dp{s.dp_rank}: {where}")
        tags = {r: sorted(t for t in tags if t is not None) for r, tags in self.tap.tags.items()}
        w = self.worker
        return (f"{self.layout.describe()}: schedulers {'; '.join(schedulers)}; batches on each rank's port tagged "
                f"{tags}; card registers ranks [{w.registered.start}, {w.registered.stop}); relays subscribe to "
                f"{ {r: e for r, e in sorted(w.subscribed.items())} }")

    def why_uncredited(self, rank: int) -> tuple[Cause, str]:
        """Why the router does not credit what rank ``rank``'s cache holds, from what each side did."""
        s, w = self.ranks[rank], self.worker
        if not s.publishes:
            return Cause.DP_RANK_UNPUBLISHED, (f"rank {rank}'s scheduler (tp_rank {s.tp_rank}, dp_rank {s.dp_rank}) is "
                                               "not a KV-event publisher: SGLang published nothing it cached")
        if rank in w.registered and rank not in w.subscribed:
            return Cause.DP_RANK_UNSUBSCRIBED, (f"the card registers ranks [{w.registered.start}, {w.registered.stop}) "
                                                f"but dynamo.sglang's relays subscribe only to {sorted(w.subscribed)}")
        if rank not in w.registered:
            return Cause.DP_RANK_UNREGISTERED, (f"SGLang runs rank {rank}, the card registers ranks "
                                                f"[{w.registered.start}, {w.registered.stop})")
        foreign = sorted(t for t in self.tap.tags.get(rank, ()) if t != rank)
        if foreign:
            return Cause.DP_RANK_TAG, (f"the batches on rank {rank}'s port ({w.subscribed[rank]}) carry attn_dp_rank "
                                       f"{foreign}, and Dynamo's relay for rank {rank} dropped them")
        return Cause.EVENTS_DROPPED, f"rank {rank}'s events were published and subscribed, but the router indexed none"

    def close(self) -> None:
        self.tap.close()
        self.worker.close()
        self.engine.close()


def _unique_best(pages: dict[int, int]) -> int | None:
    top = max(pages.values(), default=0)
    leaders = [r for r, n in pages.items() if n == top]
    return leaders[0] if top > 0 and len(leaders) == 1 else None


def dp_property(rig: DpRig, sc: DpScenario) -> None:
    """Per-rank credit and the routed rank for every prompt of one example (module docstring)."""
    from kvalign.oracles.dp_dynamo import credited_blocks

    shift = rig.token_space()
    stores = [(r % len(rig.ranks), [t + shift for t in toks]) for r, toks in sc.stores]
    ranks = sorted(rig.ranks)
    for r, toks in stores:
        rig.ranks[ranks[r]].cache.insert(toks)
    rig.settle()
    b = rig.page_size
    queries = list(dict.fromkeys(tuple(t) for t in [*(toks for _, toks in stores), *([t + shift for t in q] for q in sc.queries)]))
    for q in map(list, queries):
        engine = {r: rig.ranks[r].cache.match(q) // b for r in ranks}
        router = rig.worker.scores(q)
        if [r for r in ranks if router.get(r, 0) < engine[r] and rig.revive(r)]:  # slow, not dropped: read again
            router = rig.worker.scores(q)
        where = f"prompt of {len(q)} tokens (page {b}): SGLang's ranks hold {engine} pages, the router credits {router}"
        for r in ranks:
            got = router.get(r)
            if got is None:
                cause, why = rig.why_uncredited(r) if r in rig.worker.registered else (
                    Cause.DP_RANK_UNREGISTERED, f"SGLang runs rank {r}, the card registers ranks "
                                                f"[{rig.worker.registered.start}, {rig.worker.registered.stop})")
                raise Mismatch("dp", f"{where}; the router has no rank {r}: {why}", cause, sc)
            if got < engine[r]:
                cause, why = rig.why_uncredited(r)
                raise Mismatch("dp", f"{where}; rank {r}: {why}", cause, sc)
            if got > engine[r]:
                raise Mismatch("dp", f"{where}; rank {r} is credited with {got} pages it does not hold",
                               Cause.DP_RANK_MISATTRIBUTED, sc)
        routed = rig.worker.route(q)
        credit = credited_blocks(routed.kv_hit_rate, len(q), b)
        best = _unique_best(engine)
        if routed.sent_rank is None or routed.sent_rank != routed.reported_rank:
            raise Mismatch("dp", f"{where}; the request the router sent carries dp_rank {routed.sent_rank}, its answer "
                           f"reports rank {routed.reported_rank}", Cause.DP_ROUTED_ELSEWHERE, sc)
        if credit != router.get(routed.sent_rank):
            raise Mismatch("dp", f"{where}; the request went to rank {routed.sent_rank} with kv_hit_rate "
                           f"{routed.kv_hit_rate} ({credit} blocks), not that rank's overlap "
                           f"{router.get(routed.sent_rank)}", Cause.DP_ROUTED_ELSEWHERE, sc)
        if best is not None and routed.sent_rank != best:
            raise Mismatch("dp", f"{where}; rank {best} alone holds the most pages, the router sent the request to "
                           f"rank {routed.sent_rank}", Cause.DP_ROUTED_ELSEWHERE, sc)


Search = Callable[..., tuple[int, int, Any]]


def run_dp_rows(path: Callable[[], Any], modes: tuple[str, ...], examples: int, search: Search, *,
                seed: int | None = None, page_size: int | None = None, layouts: tuple[str, ...] = tuple(DP_LAYOUTS),
                fault: str | None = None, barrier_timeout_s: float = BARRIER_TIMEOUT_S,
                revive_timeout_s: float = REVIVE_TIMEOUT_S) -> list[Any]:
    """``check``'s ``dp`` rows: one per layout, in plain mode (no rank decision reads the key mode).

    ``path``: the in-process Dynamo runtime (``Systems.router_path``); ``search``: ``check``'s
    Hypothesis search; ``fault``: a negative control (:data:`DP_FAULTS`)."""
    from kvalign.verify.engine.rows import RowResult
    from kvalign.verify.engine.search import Tally

    if "plain" not in modes:
        return []
    rows: list[Any] = []
    for name in layouts:
        start = time.perf_counter()
        try:
            rig = DpRig(path(), DP_LAYOUTS[name], page_size=page_size or DP_PAGE_SIZE, fault=fault,
                        barrier_timeout_s=barrier_timeout_s, revive_timeout_s=revive_timeout_s)
        except OracleUnavailable as exc:
            rows.append(RowResult("dp", "plain", name, skipped=f"{exc} (kvalign's DP oracle cannot place this release's "
                                                                "ranks; the row is not checked)"))
            continue
        try:
            tally = Tally()
            calls, failures, found = search(lambda sc: dp_property(rig, sc),
                                            dp_scenarios(ranks=len(rig.ranks), page_size=rig.page_size), examples, seed=seed,
                                            tally=tally)
            row = RowResult("dp", "plain", name, calls, failures, time.perf_counter() - start)
            row.shrink_steps = tally.shrink_steps
            if found is not None:
                row.cause, row.cause_name, row.detail = found.cause.value, found.cause.name, found.detail
                row.counterexample = {"stores": found.example.stores, "queries": found.example.queries}
            else:
                row.detail = rig.facts()
            rows.append(row)
        finally:
            rig.close()
    return rows
