"""Pure-torch CPU stand-ins for the ``sgl_kernel`` ``*_cpu`` names SGLang 0.5.23 calls on CPU.

Pinned to sglang 0.5.23 (:data:`kvalign.standins.sglang_cpu.SGLANG_VERSION`); file paths below are
inside that sglang package.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports these names from ``sgl_kernel``, which PyPI ships
only as CUDA builds. Each function here has the argument order and in-place/out-param contract of
the CPU branch of the SGLang ``*_func`` that calls it, and the behaviour of the Triton kernel that
the same ``*_func`` launches on GPU: that kernel is the specification, and
``tests/unit/standins/test_sglang_cpu_standin_kernels.py`` runs it under ``TRITON_INTERPRET=1`` against
these functions (in the nightly; CI holds them to its outputs recorded on the derandomized inputs).

Triton addresses tensors through raw base pointers (``ptr + row * stride + col``), so every
function works on a flat view of the memory from each tensor's first element (``_flat``) and
reproduces the kernel's arithmetic, including reads that run past a row into the next one. Stores
cast to the destination dtype as ``tl.store`` does. The EAGLE tree kernels are sequential per
request by nature; they run in Python on ``tolist()`` copies (inputs are tiny:
``batch x num_draft_tokens``) and write back with one tensor op per buffer.
"""

from __future__ import annotations

import ctypes
from enum import IntEnum

import torch

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]

_I64 = torch.int64


class _TreeMaskMode(IntEnum):
    """Values of ``sglang.kernels.ops.speculative.spec_tree.TreeMaskMode`` (not imported: this
    module must load without SGLang's import chain)."""

    FULL_MASK = 0
    QLEN_ONLY = 1
    QLEN_ONLY_BITPACKING = 2


def _flat(t: torch.Tensor) -> torch.Tensor:
    """1-D view of the memory a Triton kernel reaches from ``t``'s base pointer (writes go through)."""
    if t.is_contiguous():
        return t.view(-1)
    if t.numel() == 0:
        return t.reshape(-1)
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
    return t.as_strided((extent,), (1,))


def _segments(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(run, offset-in-run) for every element of consecutive runs of ``max(lens, 0)`` elements."""
    n = lens.clamp(min=0)
    runs = torch.repeat_interleave(torch.arange(n.numel(), dtype=_I64), n)
    firsts = torch.cumsum(n, 0) - n
    within = torch.arange(runs.numel(), dtype=_I64) - firsts[runs]
    return runs, within


def _pool_runs(
    req_pool_indices: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    pool_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``req_to_token`` index and packed ``out_cache_loc`` index of every copied token.

    The batch is ``req_pool_indices.numel()`` (the kernels' grid; the CPU call sites pass no
    batch size). Request ``i`` covers pool columns ``[start_i, end_i)`` and packed positions from
    ``sum_{k<i} (end_k - start_k)`` on: the kernels sum the raw differences, so a negative run
    (never produced by SGLang) shifts later requests exactly as on GPU.
    """
    bs = req_pool_indices.numel()
    req = _flat(req_pool_indices)[:bs].to(_I64)
    start = _flat(start_offset)[:bs].to(_I64)
    end = _flat(end_offset)[:bs].to(_I64)
    lens = end - start
    out_base = torch.cumsum(lens, 0) - lens
    rows, within = _segments(lens)
    pool_idx = req[rows] * pool_len + start[rows] + within
    packed_idx = out_base[rows] + within
    return pool_idx, packed_idx


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Move KV rows ``src_loc[j] -> tgt_loc[j]`` in every buffer of the pool, all layers at once.

    Mirrors ``copy_all_layer_kv_cache_tiled`` (sglang/kernels/ops/kvcache/cache_move.py), called
    by ``copy_all_layer_kv_cache_func``'s CPU branch with ``tgt_loc[:num_locs]`` /
    ``src_loc[:num_locs]``. The pool hands over raw buffer addresses (``data_ptrs``, uint64) and
    row widths in bytes (``strides``), which are also the slot stride. All sources are read before
    any target is written, so overlapping moves are safe, as in the kernel.
    """
    n = tgt_loc.numel()
    if n == 0:
        return
    tgt = tgt_loc.reshape(-1).to(_I64)
    src = src_loc.reshape(-1).to(_I64)
    rows = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    for ptr, stride in zip(data_ptrs.reshape(-1).tolist(), strides.reshape(-1).tolist(), strict=True):
        if stride <= 0:
            continue
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf[tgt] = buf[src]  # advanced indexing on the right copies first


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write freshly allocated slots into each request's row: the inverse of assign_extend.

    ``req_to_token[req_i, start_i:end_i] = out_cache_loc[packed run i]``. Mirrors
    ``assign_req_to_token_pool`` (sglang/srt/mem_cache/allocation.py), called by
    ``assign_req_to_token_pool_func``'s CPU branch with ``pool_len = req_to_token.shape[1]``
    (the kernel's extra ``bs_upper`` is a Triton block size, implied here by the batch).
    """
    pool_idx, packed_idx = _pool_runs(req_pool_indices, start_offset, end_offset, pool_len)
    if pool_idx.numel():
        _flat(req_to_token)[pool_idx] = _flat(out_cache_loc)[packed_idx].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Gather each request's slots ``[start_i, end_i)`` from ``req_to_token`` into a packed array.

    ``out_cache_loc[packed run i] = req_to_token[req_i, start_i:end_i]``. Mirrors
    ``assign_extend_cache_locs`` (sglang/kernels/ops/speculative/cache_locs.py), called by the
    CPU branches of ``assign_extend_cache_locs_func`` (pool_len = ``req_to_token.shape[1]``) and
    ``fill_front_out_cache_loc_func`` (there ``req_to_token`` is the int32 verify window and
    ``out_cache_loc`` int64: values are cast on store).
    """
    pool_idx, packed_idx = _pool_runs(req_pool_indices, start_offset, end_offset, pool_len)
    if pool_idx.numel():
        _flat(out_cache_loc)[packed_idx] = _flat(req_to_token)[pool_idx].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """Copy each request's ``topk * num_cols`` draft slots starting at column ``seq_lens[i]``.

    ``out_cache_loc[i*c:(i+1)*c] = req_to_token_flat[req_i*pool_len + seq_i : ... + c]`` with
    ``c = topk * num_cols``. Mirrors ``assign_draft_cache_locs_contiguous`` without positions
    (sglang/kernels/ops/speculative/cache_locs.py); the CPU branch of
    ``assign_draft_cache_locs_contiguous_func`` asserts no positions/mrope are requested.
    """
    bs = seq_lens.shape[0]
    copy_len = topk * num_cols
    if bs == 0 or copy_len <= 0:
        return
    req = _flat(req_pool_indices)[:bs].to(_I64)
    seq = _flat(seq_lens)[:bs].to(_I64)
    src = (req * pool_len + seq).unsqueeze(1) + torch.arange(copy_len, dtype=_I64)
    values = _flat(req_to_token)[src.reshape(-1)]
    _flat(out_cache_loc)[: bs * copy_len] = values.to(out_cache_loc.dtype)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """``bonus_tokens[i] = accept_tokens_flat[accept_stride * i + accept_lens[i] - 1]``.

    The bonus token is the last accepted one of each request. Mirrors ``fill_bonus_tokens``
    (sglang/kernels/ops/speculative/eagle.py); ``fill_bonus_tokens_func``'s CPU branch drops
    ``batch_size`` (the kernel grid), which is ``accept_lens.numel()``.
    """
    bs = accept_lens.numel()
    if bs == 0:
        return
    idx = torch.arange(bs, dtype=_I64) * accept_stride + _flat(accept_lens)[:bs].to(_I64) - 1
    _flat(bonus_tokens)[:bs] = _flat(accept_tokens)[idx].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    """Pack ``out_cache_loc[accept_index[k]]`` for the accepted entries of ``accept_index``.

    Entry ``k`` goes to position ``#{j < k : accept_index[j] != -1}`` and is written only when
    ``accept_index[k] > -1`` (the kernel counts ``!= -1`` but stores ``> -1``; identical for
    SGLang's -1 padding). Mirrors ``fill_accept_out_cache_loc``
    (sglang/kernels/ops/speculative/eagle.py); the CPU branch of
    ``fill_accept_out_cache_loc_func`` drops ``size``, which is ``accept_index.numel()``.
    """
    size = accept_index.numel()
    if size == 0:
        return
    index = _flat(accept_index)[:size].to(_I64)
    counted = (index != -1).to(_I64)
    dst = torch.cumsum(counted, 0) - counted
    keep = index > -1
    values = _flat(out_cache_loc)[index[keep]]
    _flat(accept_out_cache_loc)[dst[keep]] = values.to(accept_out_cache_loc.dtype)


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Build the EAGLE verify tree: attention mask, positions and the retrieve linked lists.

    Mirrors ``sgl_build_tree_kernel_efficient_triton`` as launched by ``sgl_build_tree_kernel_triton``
    (sglang/kernels/ops/speculative/spec_tree.py); called positionally by the CPU branch of
    ``build_tree_kernel_efficient_func``. ``retrieve_next_token``/``retrieve_next_sibling`` must
    come in filled with -1 (SGLang allocates them so); entries the kernel does not touch keep
    their value, as do the ``[0, seq_len)`` prefix columns of a FULL_MASK row. On CPU SGLang uses
    QLEN_ONLY (``default_tree_mask_mode``); QLEN_ONLY_BITPACKING raises NotImplementedError, as
    the Triton wrapper does. The parent search is the kernel's: first match in ``selected_index``.
    """
    mode = int(tree_mask_mode)
    if mode == _TreeMaskMode.QLEN_ONLY_BITPACKING:
        raise NotImplementedError("QLEN_ONLY_BITPACKING is not supported (nor by SGLang's Triton reference)")
    if mode not in (_TreeMaskMode.FULL_MASK, _TreeMaskMode.QLEN_ONLY):
        raise ValueError(f"invalid tree_mask_mode {tree_mask_mode!r}")
    bs = verified_seq_len.shape[0]
    dtn = draft_token_num
    if bs == 0 or dtn <= 0:
        return
    seq = _flat(verified_seq_len)[:bs].tolist()
    pl_stride = parent_list.stride(0) if parent_list.dim() > 1 else parent_list.shape[0]
    si_stride = selected_index.stride(0)
    pl = _flat(parent_list).tolist()
    si = _flat(selected_index).tolist()
    span = bs * dtn
    next_token = _flat(retrieve_next_token)[:span].tolist()
    next_sibling = _flat(retrieve_next_sibling)[:span].tolist()
    pos = [0] * span
    rows: list[list[int]] = []  # one dtn-wide mask row per (request, draft token)
    row_starts: list[int] = []

    def find(b: int, token_idx: int) -> int:
        """First column of request b's selected_index holding token_idx, or -1."""
        base = b * si_stride
        for col in range(dtn - 1):
            if si[base + col] == token_idx:
                return col
        return -1

    prefix = 0
    for b in range(bs):
        seq_len = seq[b]
        off = b * dtn
        for i in range(dtn - 1, 0, -1):
            parent_tb = si[b * si_stride + i - 1] // topk
            if parent_tb == 0:
                parent_pos = 0
            else:
                col = find(b, pl[b * pl_stride + parent_tb])
                if col < 0:
                    continue
                parent_pos = col + 1
            old = next_token[off + parent_pos]
            next_token[off + parent_pos] = i
            if old != -1:
                next_sibling[off + i] = old
        pos[off] = seq_len
        for x in range(dtn):
            row = [True] + [False] * (dtn - 1)
            if x > 0:
                cur, steps = x - 1, 0
                for _ in range(depth):
                    steps += 1
                    row[1 + cur] = True
                    parent_tb = si[b * si_stride + cur] // topk
                    if parent_tb == 0:
                        break
                    cur = find(b, pl[b * pl_stride + parent_tb])
                    if cur < 0:
                        break
                pos[off + x] = steps + seq_len
            if mode == _TreeMaskMode.FULL_MASK:
                start = dtn * dtn * b + prefix * dtn + (seq_len + dtn) * x + seq_len
            else:
                start = dtn * dtn * b + dtn * x
            rows.append(row)
            row_starts.append(start)
        prefix += seq_len

    _flat(retrieve_index)[:span] = torch.arange(span, dtype=_I64).to(retrieve_index.dtype)
    _flat(retrieve_next_token)[:span] = torch.tensor(next_token, dtype=_I64).to(retrieve_next_token.dtype)
    _flat(retrieve_next_sibling)[:span] = torch.tensor(next_sibling, dtype=_I64).to(retrieve_next_sibling.dtype)
    _flat(positions)[:span] = torch.tensor(pos, dtype=_I64).to(positions.dtype)
    cells = torch.tensor(row_starts, dtype=_I64).unsqueeze(1) + torch.arange(dtn, dtype=_I64)
    _flat(tree_mask)[cells.reshape(-1)] = torch.tensor(rows, dtype=torch.bool).reshape(-1).to(tree_mask.dtype)


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy EAGLE verification: walk each request's draft tree while drafts match the target.

    At each level the children of the last accepted node are scanned (first child, then
    siblings); the first whose draft token equals the target's prediction at the last accepted
    node is accepted. Writes ``predicts[node] = target_predict[node]`` along the accepted path
    (including the final bonus node), ``accept_index[b, :n+1]`` and ``accept_token_num[b] = n``.
    Mirrors ``verify_tree_greedy_kernel_triton`` as launched by ``verify_tree_greedy_triton``
    (sglang/kernels/ops/speculative/spec_tree.py). Keyword names keep SGLang's ``retrive_*``
    spelling: ``verify_tree_greedy_func``'s CPU branch passes everything by keyword.
    """
    bs, ndt = candidates.shape[0], candidates.shape[1]
    nst = accept_index.shape[1]
    if bs == 0:
        return
    cand = _flat(candidates).tolist()
    r_index = _flat(retrive_index).tolist()
    r_next = _flat(retrive_next_token).tolist()
    r_sib = _flat(retrive_next_sibling).tolist()
    target = _flat(target_predict).tolist()
    accepted_nodes: list[int] = []
    accept_slots: list[int] = []
    accept_values: list[int] = []
    counts: list[int] = []
    for b in range(bs):
        base = b * ndt
        last = r_index[base]
        accept_slots.append(b * nst)
        accept_values.append(last)
        n_accept = 0
        cur = 0
        for _ in range(1, nst):
            cur = r_next[base + cur]
            want = target[last]
            matched = False
            for _ in range(ndt):
                if cur == -1:
                    break
                if cand[base + cur] == want:
                    node = r_index[base + cur]
                    accepted_nodes.append(last)
                    n_accept += 1
                    accept_slots.append(b * nst + n_accept)
                    accept_values.append(node)
                    last = node
                    matched = True
                    break
                cur = r_sib[base + cur]
            if not matched:
                break
        accepted_nodes.append(last)
        counts.append(n_accept)
    nodes = torch.tensor(accepted_nodes, dtype=_I64)
    pred = _flat(predicts)
    pred[nodes] = _flat(target_predict)[nodes].to(predicts.dtype)
    _flat(accept_index)[torch.tensor(accept_slots, dtype=_I64)] = torch.tensor(accept_values, dtype=_I64).to(
        accept_index.dtype
    )
    _flat(accept_token_num)[:bs] = torch.tensor(counts, dtype=_I64).to(accept_token_num.dtype)
