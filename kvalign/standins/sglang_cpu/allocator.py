"""CPU launches for the paged KV allocator's Triton kernels, for releases that have no CPU path.

SGLang 0.5.23's ``PagedTokenToKVPoolAllocator`` falls back to torch code (``alloc_extend_naive``,
``alloc_decode_naive``) where Triton does not run; 0.5.21 launches ``alloc_extend_kernel`` and
``alloc_decode_kernel`` (``sglang/kernels/ops/memory/allocator.py``) unconditionally, which fails
on a CPU-only machine ("0 active drivers"). The ``paged_allocator_on_cpu`` patch rebinds the two
names in ``sglang.srt.mem_cache.allocator.paged`` to :class:`Launch` objects:

* extend runs the release's *own* ``alloc_extend_naive`` (0.5.21 ships it, unused);
* decode runs :func:`alloc_decode_cpu`, a pure-torch copy of the kernel's arithmetic.

Both are held equal to the release's Triton kernels under ``TRITON_INTERPRET=1``
(``tests/unit/standins/test_sglang_cpu_standin_releases.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Launch:
    """Stands where a ``@triton.jit`` kernel is launched as ``kernel[grid](*args)``: ignores the grid
    (the function does the whole batch at once) and calls ``fn(*args)``."""

    def __init__(self, fn: Callable[..., None], name: str) -> None:
        self.fn, self.__name__ = fn, name

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self.fn


def alloc_decode_cpu(seq_lens: torch.Tensor, last_loc: torch.Tensor, free_pages: torch.Tensor,
                     out_indices: torch.Tensor, bs_upper: int, page_size: int) -> None:
    """``alloc_decode_kernel``: one new slot per request; a request whose new token starts a page
    takes the next free page (in batch order), the others the slot after ``last_loc``.

    The kernel's own arithmetic: pages after minus pages before (ceil division), an inclusive
    prefix sum over the batch, the request's own count subtracted. ``bs_upper`` (the kernel's
    power-of-two load width) changes nothing here.
    """
    bs = out_indices.numel()
    seq = seq_lens[:bs].to(torch.int64)
    new = (seq + page_size - 1) // page_size - (seq - 1 + page_size - 1) // page_size
    start = torch.cumsum(new, 0) - new
    out = last_loc[:bs].to(torch.int64) + 1
    takes = new != 0
    if bool(takes.any()):
        out[takes] = free_pages.to(torch.int64)[start[takes]] * page_size
    out_indices.copy_(out.to(out_indices.dtype))


def alloc_extend_launch(naive: Callable[..., None]) -> Callable[..., None]:
    """``alloc_extend_kernel[grid](prefix, seq, last_loc, free_pages, out, bs_upper, page_size)``
    as a call of the release's ``alloc_extend_naive`` (which takes the device instead of bs_upper)."""

    def launch(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor, free_pages: torch.Tensor,
               out_indices: torch.Tensor, bs_upper: int, page_size: int) -> None:
        naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device)

    return launch
