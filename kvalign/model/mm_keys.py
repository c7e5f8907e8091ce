"""How an image's tokens look once both sides have keyed them: runs of pad values.

SGLang replaces each placeholder token of an image with pad values of at least
``MM_PAD_SHIFT_VALUE`` (1,000,000, above every text token id of a real vocabulary), and Dynamo's
frontend fills its routing sequence the same way, so in either sequence an image is a maximal run
of ids at or above that value. Which values, how many, and whether they fit the router's u32
token ids is what the ``mm`` property and ``diagnose`` compare.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: SGLang's ``schedule_batch.MM_PAD_SHIFT_VALUE`` (0.5.18 to 0.5.23), the frontend's pad offset too.
MM_PAD_SHIFT_VALUE = 1_000_000
U32_MAX = 0xFFFFFFFF


@dataclass(frozen=True)
class Run:
    """A maximal run of pad tokens: one image."""

    start: int
    values: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.values)


def pad_runs(tokens: Sequence[int]) -> list[Run]:
    """The image runs of a sequence, in order."""
    runs: list[Run] = []
    i, n = 0, len(tokens)
    while i < n:
        if tokens[i] >= MM_PAD_SHIFT_VALUE:
            j = i
            while j < n and tokens[j] >= MM_PAD_SHIFT_VALUE:
                j += 1
            runs.append(Run(i, tuple(tokens[i:j])))
            i = j
        else:
            i += 1
    return runs


def wide_tokens(tokens: Sequence[int]) -> list[int]:
    """The token ids a u32 router token cannot hold."""
    return [t for t in tokens if t > U32_MAX]
