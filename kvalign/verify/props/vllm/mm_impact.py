"""The routing impact of an unmarked image identifier on the real router, measured as the hybrid finding's is.

The finding (tests/unit/verify/props/vllm/test_vllm_mm.py): vLLM keys an image's blocks by whatever identifier it is
handed, and Dynamo's relay reads an identifier back as an image only in Dynamo's marked form (16 hex digits and 48
zeros); any other identifier (a client's ``multi_modal_uuids``, or the blake3 digest ``dynamo.vllm`` computes when
the frontend forwarded no hashes) leaves the blocks keyed by their placeholder tokens, and the frontend then routes
by text prefix (no image hashes in the query). Rank 0 of a two-rank worker
(:class:`~kvalign.oracles.router_pair.RouterPair`) is a vLLM engine that served a prompt with one image; the query
is the same tokens with another image. Rank 1 is a fresh vLLM engine holding the query's first ``k`` blocks (its
own image at the same placeholders), for every ``k`` up to what the router credits rank 0, each ``k`` in its own
token range (as :mod:`kvalign.verify.props.vllm.impact` does); each state is routed
:data:`~kvalign.oracles.router_pair.ROUTES` times against each engine's prefix hit for the query.
"""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.trials import Trial
from kvalign.verify.props.vllm.hybrid_impact import VllmRoutingImpact, join
from kvalign.verify.props.vllm.mm import ImagePrompt

#: two identifiers of the form vLLM computes itself (64 hex digits), neither in Dynamo's marked form
SERVED_IMAGE, QUERY_IMAGE = "ab" * 32, "cd" * 32
NUM_BLOCKS = 20


def image_prompt(base: int, b: int) -> tuple[list[int], int, int]:
    """The test's prompt at block size ``b`` (a text block, an image over blocks 1-2, a text block, a 3-token
    tail): its tokens and its image's ``(offset, length)``."""
    prompt = ImagePrompt((0,), 0, 0, 2 * b, (1,), 3)
    tokens, (_h, offset, length) = prompt.tokens(base, b), prompt.images(b)[0]
    return tokens, offset, length


def measure_mm_routing(path: Any, b: int, base: int = 11 << 20) -> VllmRoutingImpact:
    """Rank 0 served the prompt with :data:`SERVED_IMAGE`; the query is its tokens with :data:`QUERY_IMAGE`,
    routed by text prefix. Rank 1 holds the query's first k blocks, k = 0 .. the blocks credited to rank 0."""
    from kvalign.oracles.router_pair import RANKS, RouterPair
    from kvalign.oracles.vllm import VllmEngine

    pair = RouterPair(path, b, eagle=False)
    engines: list[Any] = []
    barriers = iter(range((1 << 24) + 64 * (base >> 20), (1 << 24) + 64 * (base >> 20) + 64))
    try:
        for r in RANKS:
            engines.append(VllmEngine(b, NUM_BLOCKS, endpoint=pair.publishers[r].hop.xsub, dp_rank=r))
            join(pair, engines[r], next(barriers))
        impact: VllmRoutingImpact | None = None
        k = 0
        while impact is None or k <= impact.credited:
            # each k in its own token range, so each candidate's blocks arrive as one stored event
            kb = base + k * 4096
            tokens, offset, length = image_prompt(kb, b)
            served, query = [(SERVED_IMAGE, offset, length)], [(QUERY_IMAGE, offset, length)]
            engines[0].prefill(tokens, mm=served)
            if k:
                engines[1].prefill(tokens[: k * b] + [kb + b * 64 + 3], mm=_within(query, k * b))
            for r in RANKS:
                engines[r].take_events()
                join(pair, engines[r], next(barriers))  # indexed, however loaded the machine
            if impact is None:
                impact = VllmRoutingImpact(b, pair.tiers(tokens).get(0, (0, 0, 0))[0],
                                           engines[0].match(tokens, mm=query) // b,
                                           what="vLLM handed unmarked image identifiers (the frontend routing by "
                                                "text prefix)")
            pair.settle(tokens, {0: (impact.credited,), 1: (k,)})
            impact.trials.append(Trial(k, pair.picks(tokens), (engines[0].match(tokens, mm=query),
                                                               engines[1].match(tokens, mm=query))))
            k += 1
        return impact
    finally:
        for e in engines:
            e.close()
        pair.close()


def _within(images: list[tuple[str, int, int]], n: int) -> list[tuple[str, int, int]]:
    """The images of a prompt cut to its first ``n`` tokens (an image past the cut left out, one across it cut)."""
    return [(h, offset, min(length, n - offset)) for h, offset, length in images if offset < n]
