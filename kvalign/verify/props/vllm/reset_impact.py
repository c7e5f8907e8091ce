"""The routing impact of vLLM's reset published late (``VLLM_RESET_PUBLISHED_LATE``), on the real router pair.

vLLM's ``BlockPool.reset_prefix_cache`` drops every block hash and queues ``AllBlocksCleared``; vLLM's scheduler
publishes what the cache manager queued only after a model step (``Scheduler.update_from_output``), and an idle
engine runs none (``EngineCore.step`` returns at once with no request). So after ``dynamo.vllm``'s
``clear_kv_blocks`` on an idle worker the router keeps crediting the cleared blocks until that worker's next
request runs. The engines here are vLLM's real ``KVCacheManager`` (:class:`~kvalign.oracles.vllm.VllmEngine`),
whose queued events are published when the oracle takes them after a prefill: the step's publish.

Measured as the hybrid findings are (:mod:`kvalign.verify.props.vllm.hybrid_impact`): rank 0 of a two-rank worker
(:class:`~kvalign.oracles.router_pair.RouterPair`) served a prompt of :data:`PROMPT_BLOCKS` blocks and was reset
while idle; rank 1 holds the prompt's first ``k`` blocks, for k = 0 .. :data:`PROMPT_BLOCKS`, each state routed
:data:`~kvalign.oracles.router_pair.ROUTES` times against each engine's prefix hit. The control is the same with
the reset published at once (taken right after it, as a step would): no stale credit. The bound is measured on a
stream (:func:`stream`): requests for the prompt one at a time, each served by the rank the router picks (its
prefill the step that publishes what that engine queued) and indexed before the next is routed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.trials import Trial
from kvalign.verify.props.vllm.hybrid_impact import VllmRoutingImpact, join

#: the reset engine's prompt in blocks (and a token), each engine's pool, the stream's requests
PROMPT_BLOCKS, NUM_BLOCKS, STREAM = 4, 32, 4


@dataclass(frozen=True)
class Served:
    """One request of a stream: the rank the router picked, the blocks it credited that rank, what vLLM reused."""

    rank: int
    credited: int
    reused: int
    block_size: int

    @property
    def stale(self) -> bool:
        """Credited blocks the chosen engine did not hold (it reused less than credited)."""
        return self.credited * self.block_size > self.reused

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "credited": self.credited, "reused": self.reused, "stale": self.stale}


@dataclass
class ResetImpact:
    """The router's choices with rank 0's reset queued (``late``) and published at once (``at_once``), and a
    stream of requests after each (:func:`stream`)."""

    late: VllmRoutingImpact
    at_once: VllmRoutingImpact
    streams: dict[str, list[Served]] = field(default_factory=dict)

    @property
    def changes_worker(self) -> bool:
        return self.late.changes_worker

    def stale(self, name: str) -> int:
        """Requests of the stream ``name`` credited blocks their engine no longer held."""
        return sum(s.stale for s in self.streams[name])

    def says(self) -> str:
        n = len(self.streams["late"])
        return (f"{self.late.says()}; with the reset published at once (the control) it "
                f"{self.at_once.says().split(':', 1)[0]}; {n} requests for the "
                f"prompt one at a time, each served by the rank the router picks and indexed before the next: "
                f"{self.stale('late')} of them credited blocks the reset engine no longer held (the first, whose "
                f"step publishes the reset), {self.stale('at_once')} with the reset published at once")


def _prompt(base: int, b: int) -> list[int]:
    return [base + i for i in range(PROMPT_BLOCKS * b)] + [base + b * 64]


def _served_then_reset(pair: Any, engine: Any, prompt: list[int], at_once: bool, barrier: int) -> None:
    """Rank 0 serves the prompt (its events published), then is reset while idle: its ``AllBlocksCleared`` stays
    queued (no step follows), or is published at once (the control)."""
    engine.prefill(prompt)
    engine.take_events()
    if not engine.reset():
        raise OracleUnavailable("vLLM refused to reset its prefix cache (a block still in use)")
    if at_once:
        engine.take_events()
    join(pair, engine, barrier)


def trials(pair: Any, engines: list[Any], b: int, base: int, at_once: bool, barriers: Any) -> VllmRoutingImpact:
    """Rank 0 reset after serving the prompt; rank 1 holding its first k blocks, k = 0 .. :data:`PROMPT_BLOCKS`."""
    prompt = _prompt(base, b)
    _served_then_reset(pair, engines[0], prompt, at_once, next(barriers))
    credited = pair.tiers(prompt).get(0, (0, 0, 0))[0]
    impact = VllmRoutingImpact(b, credited, engines[0].match(prompt) // b,
                               what=f"vLLM (the prompt served, then the cache reset while idle, the reset "
                                    f"{'published at once' if at_once else 'queued until the next step'})")
    for k in range(PROMPT_BLOCKS + 1):
        if k:
            engines[1].prefill(prompt[: k * b] + [base + b * 64 + 3])
            engines[1].take_events()
            join(pair, engines[1], next(barriers))
        pair.settle(prompt, {0: (credited,), 1: (k,)})
        impact.trials.append(Trial(k, pair.picks(prompt), (engines[0].match(prompt), engines[1].match(prompt))))
    return impact


def stream(pair: Any, engines: list[Any], b: int, base: int, at_once: bool, barriers: Any) -> list[Served]:
    """Rank 0 reset after serving the prompt, rank 1 holding its first block; then :data:`STREAM` requests for
    the prompt one at a time, each served (prefilled, its events published: the step) by the rank the router
    picks and indexed before the next is routed."""
    prompt = _prompt(base, b)
    _served_then_reset(pair, engines[0], prompt, at_once, next(barriers))
    engines[1].prefill(prompt[:b] + [base + b * 64 + 3])
    engines[1].take_events()
    join(pair, engines[1], next(barriers))
    out = []
    for _ in range(STREAM):
        rank = pair.choice(prompt)
        credited = pair.tiers(prompt).get(rank, (0, 0, 0))[0]
        out.append(Served(rank, credited, engines[rank].prefill(prompt), b))
        engines[rank].take_events()
        join(pair, engines[rank], next(barriers))
    return out


def measure_reset_routing(path: Any, b: int, base: int = 15 << 20) -> ResetImpact:
    """The trials and the stream with rank 0's reset queued, then with it published at once; each in its own
    token range."""
    from kvalign.oracles.router_pair import RANKS, RouterPair
    from kvalign.oracles.vllm import VllmEngine

    pair = RouterPair(path, b, eagle=False)
    engines: list[Any] = []
    barriers = iter(range((1 << 25) + 64 * (base >> 20), (1 << 25) + 64 * (base >> 20) + 64))
    try:
        for r in RANKS:
            engines.append(VllmEngine(b, NUM_BLOCKS, endpoint=pair.publishers[r].hop.xsub, dp_rank=r))
            join(pair, engines[r], next(barriers))
        late = trials(pair, engines, b, base, False, barriers)
        streams = {"late": stream(pair, engines, b, base + 4096, False, barriers)}
        at_once = trials(pair, engines, b, base + 2 * 4096, True, barriers)
        streams["at_once"] = stream(pair, engines, b, base + 3 * 4096, True, barriers)
        return ResetImpact(late, at_once, streams)
    finally:
        for e in engines:
            e.close()
        pair.close()
