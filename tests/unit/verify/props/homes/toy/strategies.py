"""The toy property's generated input: a prompt of two or more whole blocks and a cut inside it."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st


@dataclass(frozen=True)
class CutPrompt:
    tokens: list[int]
    block_size: int
    #: the prefix's length in blocks, short of the whole prompt
    cut: int


@st.composite
def _cut_prompt(draw: st.DrawFn, page_size: int | None) -> CutPrompt:
    b = page_size or draw(st.sampled_from((1, 4, 16)))
    blocks = draw(st.integers(2, 4))
    tokens = draw(st.lists(st.integers(0, 2**20), min_size=blocks * b, max_size=blocks * b))
    return CutPrompt(tokens, b, draw(st.integers(1, blocks - 1)))


def cut_prompts(page_size: int | None) -> st.SearchStrategy[CutPrompt]:
    """Prompts in blocks of ``page_size`` (None: 1, 4 or 16 tokens), each with a cut."""
    return _cut_prompt(page_size)
