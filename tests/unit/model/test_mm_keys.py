"""Image runs in a token sequence: what the ``mm`` property and ``diagnose`` compare."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvalign.model.mm_keys import MM_PAD_SHIFT_VALUE, U32_MAX, Run, pad_runs, wide_tokens

TEXT = st.integers(0, MM_PAD_SHIFT_VALUE - 1)
PAD = st.integers(MM_PAD_SHIFT_VALUE, (1 << 62) + MM_PAD_SHIFT_VALUE)


def test_runs_are_maximal_and_in_order():
    seq = [5, 6, 1_000_007, 1_000_007, 9, 2**40, 2**41, 3, 1_000_001]
    assert pad_runs(seq) == [Run(2, (1_000_007, 1_000_007)), Run(5, (2**40, 2**41)), Run(8, (1_000_001,))]
    assert [r.end for r in pad_runs(seq)] == [4, 7, 9]
    assert pad_runs([1, 2, 3]) == [] and pad_runs([]) == []


@given(st.lists(st.one_of(TEXT, PAD), max_size=40))
def test_runs_cover_exactly_the_pad_tokens(seq):
    runs = pad_runs(seq)
    covered = [i for r in runs for i in range(r.start, r.end)]
    assert covered == [i for i, t in enumerate(seq) if t >= MM_PAD_SHIFT_VALUE]
    assert all(seq[r.start:r.end] == list(r.values) for r in runs)
    # maximal: two runs never touch
    assert all(a.end < b.start for a, b in zip(runs, runs[1:]))


def test_wide_tokens_are_those_above_u32():
    assert wide_tokens([U32_MAX, U32_MAX + 1, 0, 2**62]) == [U32_MAX + 1, 2**62]
