"""The inputs ``check --engine vllm`` generates: sequences of prompts that share block-aligned prefixes,
each served by a tenant, in a token range of its own per example."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import strategies as st

#: a tenant: (LoRA name, cache namespace); the namespace reaches vLLM as ``dynamo.vllm`` hands it over
Tenant = tuple[str | None, str | None]
TENANTS: list[Tenant] = [(None, None), ("adapterA", None), ("adapterB", None), (None, "t1"), (None, "t2"),
                         ("adapterA", "t1")]
#: token ids of one example: chunk c's i-th token is base + c * B + i, the tail's base + TAIL
TAIL, RANGE = 999, 4096
_ranges = itertools.count(1)


@dataclass(frozen=True)
class Served:
    """One prompt: its blocks (chunk ids from a pool of 3, so prompts share prefixes), a tail, its tenant."""

    chunks: tuple[int, ...]
    tail: int
    tenant: Tenant = (None, None)

    def tokens(self, base: int, block_size: int) -> list[int]:
        return [base + c * block_size + i for c in self.chunks for i in range(block_size)] + [base + TAIL] * self.tail


def fresh_base() -> int:
    """The next example's token range (earlier examples' blocks stay cached, unreachable, until evicted)."""
    return next(_ranges) * RANGE


def sequences(block_size: int, tenants: list[Tenant] | None = None) -> st.SearchStrategy[list[Served]]:
    """1-8 prompts of 1-5 blocks plus a 0..B-1 token tail; tenants drawn from ``tenants`` (default: none)."""
    tenant = st.sampled_from(tenants) if tenants else st.just((None, None))
    one = st.builds(Served, st.lists(st.integers(0, 2), min_size=1, max_size=5).map(tuple),
                    st.integers(0, block_size - 1), tenant)
    return st.lists(one, min_size=1, max_size=8)
