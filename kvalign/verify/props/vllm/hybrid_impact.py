"""The vLLM hybrid findings' routing impact, measured on the real router as SGLang's hybrid findings' is.

The findings (:mod:`kvalign.verify.props.vllm.hybrid`): the router credits full-attention blocks whose
sliding-window blocks vLLM evicted (kind ``swa``), or past the last Mamba state vLLM kept on the prompt's path
(kind ``mamba``), and vLLM reuses none of them. Whether that moves a request is asked of a real
``KvRouter`` with two candidates (:class:`~kvalign.oracles.router_pair.RouterPair`: one worker, two
data-parallel ranks, one Dynamo relay each): rank 0 is a hybrid vLLM engine after the finding's steps
(:func:`finding_steps`: a prompt of :data:`PROMPT_BLOCKS` blocks served twice, then a short prompt that evicts
sliding-window blocks only; or, on the Mamba hybrid, that prompt served once), rank 1 a fresh hybrid vLLM engine
of the same kind holding the query's first ``k`` blocks intact (its own prefill of them and a token: on the Mamba
hybrid a state is kept at the k-th block), for every ``k`` up to the blocks the router credits rank 0. Each state is routed :data:`~kvalign.oracles.router_pair.ROUTES` times and
each engine says what it reuses (:class:`~kvalign.verify.engine.trials.Trial`). Both engines are vLLM's real
``KVCacheManager`` publishing through vLLM's ``ZmqEventPublisher`` into the pair's relays (batches tagged with
their rank, as a data-parallel vLLM engine tags its own).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.router_path import SENTINEL_BASE, sentinel_hash
from kvalign.verify.engine.trials import Trial, tie_share, worst_flip
from kvalign.verify.props.vllm.hybrid import NUM_BLOCKS

#: the finding's prompt, in blocks (the query is its first QUERY_BLOCKS blocks and one token)
PROMPT_BLOCKS, QUERY_BLOCKS = 5, 4
#: seconds a candidate's first event may take to reach the pair's router (ZMQ's slow joiner)
JOIN_TIMEOUT_S = 30.0
#: the barrier's polls, from the first to the longest pause: on loopback a joined router indexes it within
#: milliseconds, and a measurement joins 6-24 times (each sat out a flat 0.2 s)
JOIN_POLL_FIRST_S, JOIN_POLL_MAX_S = 0.01, 0.2
#: each hybrid kind's engine options at block size ``b`` (a window of two blocks, or a Mamba group in vLLM's
#: default ``'align'`` mode) and, in words, the engine the finding's state is on
KINDS: dict[str, tuple[Callable[[int], dict[str, Any]], str]] = {
    "swa": (lambda b: {"sliding_window": 2 * b}, ""),
    "mamba": (lambda b: {"mamba": True}, "vLLM hybrid (full attention + Mamba, vLLM's default 'align' mode)"),
}


def finding_steps(kind: str, first: list[int], b: int, base: int) -> list[list[int]]:
    """The prompts that leave the finding's state on a fresh hybrid engine of ``kind``: on the window hybrid the
    first prompt twice (the second time the window group touches only the window before the hit) and a short
    prompt whose allocation evicts the earlier window blocks; on the Mamba hybrid the first prompt once (its
    prefill one scheduler step to its last block boundary: one state kept, at its end)."""
    if kind == "mamba":
        return [first]
    return [first, first, [base + b * 32 + i for i in range(2 * b)] + [base + b * 64 + 1]]


@dataclass
class VllmRoutingImpact:
    """The real router's choices on the finding's state against a candidate holding the query's prefix intact."""

    block_size: int
    credited: int  # blocks the router credits rank 0 for the query
    reusable: int  # blocks vLLM's rank-0 engine reuses of them
    what: str = ""  # rank 0's engine, in words (default: the hybrid one)
    trials: list[Trial] = field(default_factory=list)

    @property
    def changes_worker(self) -> bool:
        return any(t.changed for t in self.trials)

    def says(self) -> str:
        engine = self.what or f"vLLM hybrid (window {2 * self.block_size} tokens)"
        state = (f"{engine}, block size {self.block_size}: the router credits {self.credited} block(s), vLLM reuses "
                 f"{self.reusable}")
        t = worst_flip(self.trials)
        if t is None:
            return f"does not change the worker: {state}; {tie_share(self.trials)}"
        flips = [x.k for x in self.trials if x.changed]
        return (f"changes the worker for {len(flips)} of {len(self.trials)} k ({', '.join(map(str, flips))}): {state};"
                f" with the other holding {t.k} block(s) intact the router picks the "
                f"{'first' if t.chosen == 0 else 'other'} every time, which reuses {t.reused[t.chosen]} tokens where "
                f"the {'other' if t.chosen == 0 else 'first'} would reuse {t.reused[1 - t.chosen]}; "
                f"{tie_share(self.trials)}")


def join(pair: Any, engine: Any, k: int) -> None:
    """Publish a barrier block on ``engine`` until the pair's router indexed it (the relay's subscription to
    the hop joins after vLLM's publisher connects; what vLLM publishes before that is lost)."""
    deadline, pause = time.monotonic() + JOIN_TIMEOUT_S, JOIN_POLL_FIRST_S
    while time.monotonic() < deadline:
        engine.publish_sentinel(sentinel_hash(k), SENTINEL_BASE + k)
        time.sleep(pause)
        pause = min(2 * pause, JOIN_POLL_MAX_S)
        for entry in json.loads(pair.path.call(pair.router.dump_events)):
            stored = entry["event"]["data"].get("stored") if isinstance(entry["event"]["data"], dict) else None
            if stored and any(int(b["block_hash"]) == sentinel_hash(k) for b in stored["blocks"]):
                return
    raise OracleUnavailable(f"the two-rank router never indexed vLLM rank {k % 2}'s barrier block")


def measure_hybrid_routing(path: Any, b: int, base: int = 7 << 20, kind: str = "swa") -> VllmRoutingImpact:
    """The finding's state on rank 0, a candidate holding k blocks of the query on rank 1, for k = 0 .. credit,
    both hybrid engines of ``kind`` (:data:`KINDS`)."""
    from kvalign.oracles.router_pair import RANKS, RouterPair
    from kvalign.oracles.vllm import VllmEngine

    options, what = KINDS[kind]
    pair = RouterPair(path, b, eagle=False)
    engines: list[Any] = []
    barriers = [(1 << 22) + 4 * (base >> 20) + i for i in range(3)]  # rank 0's, rank 1's, rank 0's after the steps
    try:
        for r in RANKS:
            engines.append(VllmEngine(b, NUM_BLOCKS, endpoint=pair.publishers[r].hop.xsub, dp_rank=r, **options(b)))
            join(pair, engines[r], barriers[r])
        first = [base + i for i in range(PROMPT_BLOCKS * b)] + [base + b * 64]
        for tokens in finding_steps(kind, first, b, base):
            engines[0].prefill(tokens)
            engines[0].take_events()
        join(pair, engines[0], barriers[2])  # every event of the steps indexed (one stream, in order)
        query = first[: QUERY_BLOCKS * b] + [base + b * 64 + 2]
        credited = pair.tiers(query).get(0, (0, 0, 0))[0]
        impact = VllmRoutingImpact(b, credited, engines[0].match(query) // b, what=what)
        for k in range(credited + 1):
            if k:
                engines[1].prefill(query[: k * b] + [base + b * 64 + 3])
                engines[1].take_events()
            pair.settle(query, {0: (credited,), 1: (k,)})
            impact.trials.append(Trial(k, pair.picks(query), (engines[0].match(query), engines[1].match(query))))
        return impact
    finally:
        for e in engines:
            e.close()
        pair.close()
