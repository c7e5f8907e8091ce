"""A vLLM finding's routing impact, measured on the real router pair as SGLang's are
(:mod:`kvalign.verify.engine.impact`).

Two vLLM engines (vLLM's real ``KVCacheManager`` each, in vLLM's own interpreter) are the two candidates of one
real ``KvRouter`` (:class:`~kvalign.oracles.router_pair.RouterPair`: one worker, two data-parallel ranks, a
Dynamo relay per rank); each engine's own ``ZmqEventPublisher`` publishes into its rank's relay, its batches
tagged with that rank. Rank 0 holds the finding's state: a 3-block prompt served with a salt that lacks
Dynamo's prefix (``VLLM_SALT_UNPREFIXED``), or served by a vLLM publishing bytes hashes
(``VLLM_BYTES_HASHES_DROPPED``). Rank 1 holds the prompt's first ``k`` blocks, served plainly. For each
``k`` the router routes the unsalted prompt :data:`~kvalign.oracles.router_pair.ROUTES` times, and each engine
says what it would reuse of it (``get_computed_blocks``: vLLM's prefix hit). A choice *changes* where the
router picks, every time, the candidate that reuses strictly less; a split is a tie, never a flip.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from kvalign.model.causes import Cause
from kvalign.verify.engine.trials import Trial, tie_share, trials_said, worst_flip

#: the finding's prompt: this many full blocks plus a tail (vLLM reuses at most (n - 1) // B blocks)
BLOCKS, TAIL = 3, 5
#: the raw salt rank 0 is served with (no ``dynamo-cache-salt:`` prefix)
RAW_SALT = "tenant-x"
#: the environment rank 0's vLLM runs with, per cause
FINDING_ENV: dict[Cause, dict[str, str] | None] = {
    Cause.VLLM_SALT_UNPREFIXED: None,
    Cause.VLLM_BYTES_HASHES_DROPPED: {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"},
}
BARRIER_TIMEOUT_S = 30.0
_sentinels = itertools.count(1 << 21)


@dataclass
class VllmImpact:
    """The real router's choices between the finding's engine (rank 0) and one holding k plain blocks (rank 1)."""

    cause: Cause
    block_size: int
    trials: list[Trial] = field(default_factory=list)
    #: per k, the router's device overlap (blocks) for the prompt on rank 0 and rank 1
    credited: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def changes_worker(self) -> bool:
        return any(t.changed for t in self.trials)

    def state(self) -> str:
        n = BLOCKS * self.block_size + TAIL
        held = (f"holding its {BLOCKS} blocks stored with cache_salt {RAW_SALT!r} (no Dynamo prefix)"
                if self.cause is Cause.VLLM_SALT_UNPREFIXED else
                f"holding its {BLOCKS} blocks, published with bytes block hashes")
        return f"block size {self.block_size}, an unsalted {n}-token prompt, one candidate {held}"

    def says(self) -> str:
        t = worst_flip(self.trials)
        if t is not None:
            flips = [x.k for x in self.trials if x.changed]
            picked = "the first" if t.chosen == 0 else "the other"
            return (f"changes the worker for {len(flips)} of {len(self.trials)} k ({', '.join(map(str, flips))}): "
                    f"{self.state()}; with the other holding {t.k} block(s) the router picks {picked} every time, which "
                    f"reuses {t.reused[t.chosen]} tokens where the {'other' if t.chosen == 0 else 'first'} would reuse "
                    f"{t.reused[1 - t.chosen]}; {tie_share(self.trials)}")
        return (f"does not change the worker: {self.state()}; other candidate holding k blocks: "
                f"{trials_said(self.trials)}; {tie_share(self.trials)}")

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state(), "trials": [{**t.as_dict(), "credited": list(c)}
                                                  for t, c in zip(self.trials, self.credited, strict=True)]}


def _barrier(pair: Any, rank: int, engine: Any, block_size: int) -> None:
    """Publish a sentinel block on ``engine``'s publisher until the router credits it to ``rank``: everything the
    engine published before it was relayed (one stream, in order)."""
    from kvalign.oracles.base import OracleUnavailable
    from kvalign.oracles.router_path import SENTINEL_BASE, sentinel_hash

    k = next(_sentinels)
    tokens = [SENTINEL_BASE + k] * block_size
    deadline, sent = time.monotonic() + BARRIER_TIMEOUT_S, 0.0
    while time.monotonic() < deadline:
        if time.monotonic() - sent > 1.0:
            engine.publish_sentinel(sentinel_hash(k), SENTINEL_BASE + k)
            sent = time.monotonic()
        time.sleep(0.05)
        if pair.tiers(tokens).get(rank, (0,))[0] == 1:
            return
    raise OracleUnavailable(f"the two-rank router never indexed rank {rank}'s vLLM barrier")


def measure(cause: Cause, path: Any, block_size: int = 16, num_blocks: int = 64) -> VllmImpact:
    """For k = 0 .. :data:`BLOCKS`: the router's choice for the unsalted prompt between rank 0 (the finding's
    state) and rank 1 (its first k blocks), and what each vLLM reuses of it."""
    from kvalign.oracles.router_pair import RouterPair
    from kvalign.oracles.vllm import VllmEngine

    b = block_size
    pair = RouterPair(path, b, False)
    engines: list[Any] = []
    try:
        for rank, env in ((0, FINDING_ENV[cause]), (1, None)):
            engines.append(VllmEngine(b, num_blocks, endpoint=pair.publishers[rank].hop.xsub, env=env, dp_rank=rank))
            _barrier(pair, rank, engines[rank], b)
        first, other = engines
        impact = VllmImpact(cause, b)
        for k in range(BLOCKS + 1):
            base = (k + 1) * 4096 + (1 << 22)  # each trial in its own token range of the long-lived router
            prompt = list(range(base, base + BLOCKS * b)) + [base + 999] * TAIL
            first.prefill(prompt, cache_salt=RAW_SALT if cause is Cause.VLLM_SALT_UNPREFIXED else None)
            if k:
                other.prefill(prompt[: k * b])
            for rank, engine in enumerate(engines):
                engine.take_events()
                _barrier(pair, rank, engine, b)
            impact.credited.append(tuple(pair.tiers(prompt).get(r, (0,))[0] for r in (0, 1)))
            impact.trials.append(Trial(k, pair.picks(prompt), (first.match(prompt), other.match(prompt))))
        return impact
    finally:
        for engine in engines:
            engine.close()
        pair.close()
