"""The routing impact of vllm#57159 on the real router: host credit for blocks of a chunk vLLM loads only whole.

The finding (:mod:`kvalign.verify.props.vllm.tiers`, tests/unit/verify/props/vllm/test_tiers_chunks.py): with a
CPU tier of :data:`CHUNK`-block chunks, a prompt sharing all but the last block of a stored chunk is credited
those blocks in the host tier, and the offload connector loads none of them. Measured as the hybrid finding's
impact is (:mod:`kvalign.verify.props.vllm.hybrid_impact`): rank 0 of a two-rank worker
(:class:`~kvalign.oracles.router_pair.RouterPair`, the binding's default ``host_cache_hit_weight``) is a vLLM
engine with that CPU tier after the finding's steps, rank 1 a fresh vLLM engine holding the query's first ``k``
blocks on device, for every ``k`` up to the host blocks credited; each state routed
:data:`~kvalign.oracles.router_pair.ROUTES` times against what each engine then holds after its connector's load.
"""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.trials import Trial
from kvalign.verify.props.vllm.hybrid_impact import VllmRoutingImpact, join

#: blocks a chunk, device blocks of each engine, chunks of rank 0's CPU tier
CHUNK, NUM_BLOCKS, NUM_CHUNKS = 4, 10, 8


def measure_chunk_routing(path: Any, b: int, base: int = 9 << 20) -> VllmRoutingImpact:
    """Rank 0: a chunk stored in the CPU tier and evicted from the device; the query shares all but the chunk's
    last block. Rank 1: k blocks of the query on device, k = 0 .. the host blocks the router credits rank 0."""
    from kvalign.oracles.router_pair import RANKS, RouterPair
    from kvalign.oracles.vllm import VllmEngine

    pair = RouterPair(path, b, eagle=False)
    engines: list[Any] = []
    barriers = [(1 << 23) + 4 * (base >> 20) + i for i in range(3)]
    try:
        for r in RANKS:
            offload = {"blocks_per_chunk": CHUNK, "num_chunks": NUM_CHUNKS} if r == 0 else None
            engines.append(VllmEngine(b, NUM_BLOCKS, endpoint=pair.publishers[r].hop.xsub, offload=offload, dp_rank=r))
            join(pair, engines[r], barriers[r])
        first = [base + i for i in range(CHUNK * b)] + [base + b * 64]
        evicting = [[base + b * (8 + 4 * j) + i for i in range(CHUNK * b)] + [base + b * 64 + 1] for j in range(2)]
        for tokens in (first, *evicting):
            engines[0].prefill(tokens)
            engines[0].take_events()
        join(pair, engines[0], barriers[2])
        query = first[: (CHUNK - 1) * b] + [base + b * 64 + 2]
        device, host, _disk = pair.tiers(query).get(0, (0, 0, 0))
        impact = VllmRoutingImpact(b, device + host, engines[0].match(query) // b,
                                  what=f"vLLM CPU tier of {CHUNK}-block chunks")
        for k in range(device + host + 1):
            if k:
                engines[1].prefill(query[: k * b] + [base + b * 64 + 3])
                engines[1].take_events()
            pair.settle(query, {0: (device, host), 1: (k,)})
            impact.trials.append(Trial(k, pair.picks(query), (engines[0].match(query), engines[1].match(query))))
        return impact
    finally:
        for e in engines:
            e.close()
        pair.close()
