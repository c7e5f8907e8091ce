"""kvalign.model.hashing.sequence_hashes against the sequence hashes the REAL Dynamo router computes.

The binding exposes only local hashes; the chain is observed through an in-process
approximate-mode ``KvRouter`` (see ``dynamo_router.py``): for each request the router's stored
``(block_hash, tokens_hash)`` path must equal ``(sequence_hashes(local), local)``. A wrong chain
(other seed, swapped operands, salted chain, no chain) must fail the same comparison.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_router import DynamoRouterOracle
from kvalign.model.hashing import XXH3_SEED, block_hashes, salt_seed, sequence_hashes
from kvalign.verify.engine.strategies import HashCase, mm_infos, names, token_ids

BLOCK_SIZES = (1, 2, 4, 16, 64)

Chain = Callable[[Sequence[int]], list[int]]


@pytest.fixture(scope="module")
def router_oracle() -> Iterator[DynamoRouterOracle]:
    """One in-process Dynamo runtime with a router per (block size, eagle), for this module."""
    try:
        oracle = DynamoRouterOracle()
    except ImportError as exc:  # raised only by ``from dynamo import _core``
        pytest.skip(f"dynamo._core (ai-dynamo-runtime) is not importable: {exc}")
    with oracle:
        yield oracle


@st.composite
def router_requests(draw: st.DrawFn) -> HashCase:
    """One routed request: lengths around whole blocks, tiny or full-u32 vocabulary, any tenant."""
    b = draw(st.sampled_from(BLOCK_SIZES))
    n = draw(st.one_of(st.sampled_from([b, b + 1, 2 * b, 2 * b + 1]), st.integers(0, 3 * b + 2)))
    return HashCase(
        tokens=draw(token_ids(min_size=n, max_size=n, vocab=8 if draw(st.booleans()) else None)),
        block_size=b,
        eagle=draw(st.booleans()),
        lora_name=draw(names()),
        cache_namespace=draw(names()),
        mm_infos=draw(st.one_of(st.none(), mm_infos(n // b + 1))),
    )


def local_hashes(case: HashCase) -> list[int]:
    return block_hashes(case.tokens, case.block_size, eagle=case.eagle, lora_name=case.lora_name,
                        cache_namespace=case.cache_namespace, mm_infos=case.mm_infos)


def assert_router_chain(oracle: DynamoRouterOracle, case: HashCase, chain: Chain) -> None:
    """The router's stored path for ``case`` is exactly ``(chain(local), local)``, block by block,
    and the request added exactly the blocks past its reported overlap (nothing else)."""
    local = local_hashes(case)
    got = oracle.chain(case.tokens, case.block_size, local, eagle=case.eagle, lora_name=case.lora_name,
                       cache_namespace=case.cache_namespace, mm_infos=case.mm_infos)
    assert got.pairs == list(zip(chain(local), local)), f"router path {got.pairs} for local hashes {local}"
    assert got.stored == set(got.pairs[got.overlap:]), f"request stored {sorted(got.stored)}, overlap {got.overlap}"


@pytest.mark.timeout(120)
@settings(max_examples=max(10, settings.default.max_examples // 4))
@given(case=router_requests())
def test_sequence_hashes_equal_real_router(router_oracle, count_case, case):
    count_case()
    assert_router_chain(router_oracle, case, sequence_hashes)


def _chain(link: Callable[[int, int], int]) -> Chain:
    def chain(local: Sequence[int]) -> list[int]:
        out: list[int] = []
        for h in local:
            out.append(h if not out else link(out[-1], h))
        return out
    return chain


CASE = HashCase(tokens=list(range(100, 117)), block_size=4, eagle=True, lora_name="loraA", cache_namespace="tenant-1")

WRONG_CHAINS: dict[str, Chain] = {
    "seed 0": _chain(lambda p, h: xxhash.xxh3_64_intdigest(struct.pack("<QQ", p, h), 0)),
    "local before parent": _chain(lambda p, h: xxhash.xxh3_64_intdigest(struct.pack("<QQ", h, p), XXH3_SEED)),
    "chain seeded with lora+namespace": _chain(
        lambda p, h: xxhash.xxh3_64_intdigest(struct.pack("<QQ", p, h), salt_seed(CASE.lora_name, CASE.cache_namespace))),
    "no chain (seq = local)": lambda local: list(local),
}


@pytest.mark.parametrize("wrong", list(WRONG_CHAINS), ids=list(WRONG_CHAINS))
def test_wrong_chain_is_detected(router_oracle, wrong):
    """Negative control: the comparison above rejects each plausible wrong chain on a 4-block request."""
    assert_router_chain(router_oracle, CASE, sequence_hashes)  # the case itself is a valid probe
    with pytest.raises(AssertionError, match="router path"):
        assert_router_chain(router_oracle, CASE, WRONG_CHAINS[wrong])
