"""Torch copies in place of ``sgl_kernel.kvcacheio``'s MHA transfer ops, for HiCache on a CPU engine.

SGLang's host pool (``sglang/srt/mem_cache/pool_host/mha.py``) moves KV between the device pool
and the host pool through these ops; on CUDA they are kernels of ``sglang-kernel`` (0.4.10 for
SGLang 0.5.23), with no torch fallback in SGLang. Each function here has the signature of the
release's Python wrapper (``sgl_kernel/kvcacheio.py``, read from the wheel) and does what the
kernel does (``sgl-kernel/csrc/kvcacheio/transfer.cu``), on the CPU:

* the *kernel* ops copy ``item_size`` **bytes** per index, addressed exactly as the kernel's offset
  functions address them: layer-first ``base + layer * layer_dim + index * item_size``, page-first
  ``base + index * page_dim + layer * item_size``, and through a layer table
  ``table[layer] + index * item_size`` (a ``uint64`` tensor of addresses: the device pool's
  ``k_data_ptrs``, the host pool's ``make_kernel_ptr_table``); an index pair with a negative entry
  is skipped, as the kernel skips it; ``item_size`` must be a multiple of 8 and the index tensors
  ``int64`` of equal length (the kernel's ``TORCH_CHECK``\\ s, raised as ``RuntimeError``);
* the *direct* ops are already torch code in the kernel library (``slice(...).copy_(...)`` over
  runs of consecutive indices, page by page for the page-first-direct layout); they are repeated
  here as written.

Which op SGLang calls is decided by SGLang (``--hicache-io-backend``, ``--hicache-mem-layout``); the
CPU worker runs SGLang's defaults (``kernel``, ``page_first``): ``transfer_kv_all_layer_lf_pf``
writes device pages to host, ``transfer_kv_per_layer_pf_lf`` loads them back layer by layer. The
MLA and page-head ops are not covered (a Llama never calls them): they raise, naming themselves.

Held equal to sgl-kernel's own torch references (``ref_copy_with_indices``,
``ref_copy_with_indices_pf_direct`` of ``sgl-kernel/tests/test_kvcacheio.py``) and to SGLang's real
host pool (``MHATokenToKVPoolHost`` built on these ops, read back through its own
``get_data_page``) by ``tests/unit/standins/test_hicache_cpu_kvcacheio.py``, with mutants that
must fail.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

#: The ops an MHA host pool calls, by (io backend, layout) -> (load one layer, back up all layers).
MHA_OPS = {
    ("kernel", "layer_first"): ("transfer_kv_per_layer", "transfer_kv_all_layer"),
    ("kernel", "page_first"): ("transfer_kv_per_layer_pf_lf", "transfer_kv_all_layer_lf_pf"),
    ("direct", "layer_first"): ("transfer_kv_direct", "transfer_kv_direct"),
    ("direct", "page_first_direct"): ("transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf"),
}

#: Names SGLang imports from ``sgl_kernel.kvcacheio`` that the stand-in does not implement.
UNCOVERED = ("transfer_kv_per_layer_ph_lf", "transfer_kv_all_layer_lf_ph", "transfer_kv_per_layer_mla",
             "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf")


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise RuntimeError(what)


class _Bytes:
    """A byte-addressed view of memory: a tensor's whole storage (bounds checked by torch), or the
    region a raw address of a layer table points at (as unchecked as the kernel's pointer)."""

    def __init__(self, data: torch.Tensor, base: int) -> None:
        self.data, self.base = data, base

    @classmethod
    def of_tensor(cls, t: torch.Tensor) -> _Bytes:
        storage = t.untyped_storage()
        data = torch.empty(0, dtype=torch.uint8).set_(storage)
        return cls(data, t.data_ptr() - storage.data_ptr())

    @classmethod
    def at_address(cls, address: int, nbytes: int) -> _Bytes:
        if nbytes <= 0:
            return cls(torch.empty(0, dtype=torch.uint8), 0)
        buffer = (ctypes.c_uint8 * nbytes).from_address(address)
        return cls(torch.frombuffer(buffer, dtype=torch.uint8), 0)


def _pairs(src_indices: torch.Tensor, dst_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(src_indices.dtype == torch.int64, "Source indices must be of type long")
    _check(dst_indices.dtype == torch.int64, "Destination indices must be of type long")
    _check(src_indices.numel() == dst_indices.numel(), "Source and destination indices must have the same length")
    src, dst = src_indices.reshape(-1).cpu(), dst_indices.reshape(-1).cpu()
    keep = (src >= 0) & (dst >= 0)  # transfer_kernel_impl: `if (src_page_id < 0 || dst_page_id < 0) continue;`
    return src[keep], dst[keep]


def _copy_items(src: _Bytes, src_off: torch.Tensor, dst: _Bytes, dst_off: torch.Tensor, item_size: int) -> None:
    """``transfer_item_warp`` for every item: ``item_size`` bytes from each source offset to its destination."""
    if src_off.numel() == 0:
        return
    span = torch.arange(item_size, dtype=torch.int64)
    s = (src.base + src_off)[:, None] + span
    d = (dst.base + dst_off)[:, None] + span
    dst.data[d.reshape(-1)] = src.data[s.reshape(-1)]


def _table(layers: torch.Tensor, layer: int, indices: torch.Tensor, item_size: int) -> tuple[_Bytes, torch.Tensor]:
    """``get_global_offset_lf_tbl``: the layer's address from the table, then ``index * item_size``."""
    address = int(layers.reshape(-1)[layer].item()) & ((1 << 64) - 1)  # uint64 read back as int64
    offsets = indices * item_size
    extent = int(offsets.max().item()) + item_size if offsets.numel() else 0
    return _Bytes.at_address(address, extent), offsets


def _launch(item_size: int, src_indices: torch.Tensor, dst_indices: torch.Tensor, layers: range,
            k_pairs: Sequence[tuple[Callable[[int, torch.Tensor], tuple[_Bytes, torch.Tensor]],
                                    Callable[[int, torch.Tensor], tuple[_Bytes, torch.Tensor]]]]) -> None:
    """``transfer_kv_launcher`` + ``transfer_kernel_impl``: for each layer and each (src, dst) addressing
    pair (K, then V), copy every kept item."""
    _check(item_size % 8 == 0, "Item byte size must be divisible by 8")
    src_idx, dst_idx = _pairs(src_indices, dst_indices)
    for layer in layers:
        for src_at, dst_at in k_pairs:
            src, so = src_at(layer, src_idx)
            dst, do = dst_at(layer, dst_idx)
            _copy_items(src, so, dst, do, item_size)


def _lf(t: torch.Tensor, layer_dim: int, item_size: int) -> Callable[[int, torch.Tensor], tuple[_Bytes, torch.Tensor]]:
    """``get_global_offset_lf``: ``base + layer * layer_dim + index * item_size``."""
    view = _Bytes.of_tensor(t)
    return lambda layer, idx: (view, layer * layer_dim + idx * item_size)


def _pf(t: torch.Tensor, page_dim: int, item_size: int) -> Callable[[int, torch.Tensor], tuple[_Bytes, torch.Tensor]]:
    """``get_global_offset_pf``: ``base + index * page_dim + layer * item_size``."""
    view = _Bytes.of_tensor(t)
    return lambda layer, idx: (view, idx * page_dim + layer * item_size)


def _tbl(layers: torch.Tensor, item_size: int) -> Callable[[int, torch.Tensor], tuple[_Bytes, torch.Tensor]]:
    return lambda layer, idx: _table(layers, layer, idx, item_size)


def transfer_kv_per_layer(src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor, dst_v: torch.Tensor,
                          src_indices: torch.Tensor, dst_indices: torch.Tensor, item_size: int,
                          block_quota: int = 2, num_warps_per_block: int = 32) -> None:
    """One layer, layer-first on both sides (``lf`` -> ``lf``, layer 0 of the given tensors)."""
    _launch(item_size, src_indices, dst_indices, range(0, 1),
            [(_lf(src_k, 0, item_size), _lf(dst_k, 0, item_size)), (_lf(src_v, 0, item_size), _lf(dst_v, 0, item_size))])


def transfer_kv_per_layer_pf_lf(src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor, dst_v: torch.Tensor,
                                src_indices: torch.Tensor, dst_indices: torch.Tensor, layer_id: int, item_size: int,
                                src_layout_dim: int, block_quota: int = 2, num_warps_per_block: int = 32) -> None:
    """Layer ``layer_id`` of a page-first source (``src_layout_dim`` bytes per index) into a layer-first destination."""
    _launch(item_size, src_indices, dst_indices, range(layer_id, layer_id + 1),
            [(_pf(src_k, src_layout_dim, item_size), _lf(dst_k, 0, item_size)),
             (_pf(src_v, src_layout_dim, item_size), _lf(dst_v, 0, item_size))])


def transfer_kv_all_layer(src_k_layers: torch.Tensor, dst_k_layers: torch.Tensor, src_v_layers: torch.Tensor,
                          dst_v_layers: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                          item_size: int, num_layers: int, block_quota: int = 2, num_warps_per_block: int = 32) -> None:
    """Every layer, through layer tables on both sides."""
    _check(num_layers == src_k_layers.size(0), "Number of layers in source k tensor does not match num_layers")
    _launch(item_size, src_indices, dst_indices, range(num_layers),
            [(_tbl(src_k_layers, item_size), _tbl(dst_k_layers, item_size)),
             (_tbl(src_v_layers, item_size), _tbl(dst_v_layers, item_size))])


def transfer_kv_all_layer_lf_pf(src_k_layers: torch.Tensor, dst_k: torch.Tensor, src_v_layers: torch.Tensor,
                                dst_v: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                item_size: int, dst_layout_dim: int, num_layers: int, block_quota: int = 2,
                                num_warps_per_block: int = 32) -> None:
    """Every layer, from layer tables into a page-first destination (``dst_layout_dim`` bytes per index)."""
    _check(num_layers == src_k_layers.size(0), "Number of layers in source k tensor does not match num_layers")
    _launch(item_size, src_indices, dst_indices, range(num_layers),
            [(_tbl(src_k_layers, item_size), _pf(dst_k, dst_layout_dim, item_size)),
             (_tbl(src_v_layers, item_size), _pf(dst_v, dst_layout_dim, item_size))])


def _direct_checks(src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    _check(src_indices.numel() == dst_indices.numel(), "Source and destination indices must have the same length")
    _check(page_size > 0, "Page size must be positive")
    _check(src_indices.numel() % page_size == 0, "Source indices size must be divisible by page size")


def transfer_kv_direct(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor], src_indices: torch.Tensor,
                       dst_indices: torch.Tensor, page_size: int) -> None:
    """Runs of consecutive indices (on both sides) copied as slices, layer by layer."""
    _check(len(src_layers) == len(dst_layers), "Source and destination layers must have the same number of layers")
    _direct_checks(src_indices, dst_indices, page_size)
    src, dst = src_indices.reshape(-1).cpu().tolist(), dst_indices.reshape(-1).cpu().tolist()
    start = 0
    for i in range(len(src)):
        if i < len(src) - 1 and src[i + 1] - src[i] == 1 and dst[i + 1] - dst[i] == 1:
            continue
        n = i + 1 - start
        for s_layer, d_layer in zip(src_layers, dst_layers):
            d_layer[dst[start]:dst[start] + n].copy_(s_layer[src[start]:src[start] + n])
        start = i + 1


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: list[torch.Tensor], dst_ptrs: list[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor, layer_id: int,
                                       page_size: int) -> None:
    """Page-first-direct host pages (``[page, layer, page_size, ...]``) into layer-first layers, one layer."""
    _direct_checks(src_indices, dst_indices, page_size)
    src, dst = src_indices.reshape(-1).cpu(), dst_indices.reshape(-1).cpu()
    is_mla = len(src_ptrs) == 1
    num_layers = len(dst_ptrs) if is_mla else len(dst_ptrs) // 2
    for i in range(src.numel() // page_size):
        s_page, d_index = int(src[i * page_size]) // page_size, int(dst[i * page_size])
        for j in range(num_layers):
            dst_ptrs[j][d_index:d_index + page_size].copy_(src_ptrs[0][s_page][layer_id + j][:page_size])
            if not is_mla:
                dst_ptrs[j + num_layers][d_index:d_index + page_size].copy_(src_ptrs[1][s_page][layer_id + j][:page_size])


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: list[torch.Tensor], dst_ptrs: list[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """Layer-first layers into page-first-direct host pages, every layer."""
    _direct_checks(src_indices, dst_indices, page_size)
    src, dst = src_indices.reshape(-1).cpu(), dst_indices.reshape(-1).cpu()
    is_mla = len(dst_ptrs) == 1
    num_layers = len(src_ptrs) if is_mla else len(src_ptrs) // 2
    for i in range(src.numel() // page_size):
        s_index, d_page = int(src[i * page_size]), int(dst[i * page_size]) // page_size
        for j in range(num_layers):
            dst_ptrs[0][d_page][j][:page_size].copy_(src_ptrs[j][s_index:s_index + page_size])
            if not is_mla:
                dst_ptrs[1][d_page][j][:page_size].copy_(src_ptrs[j + num_layers][s_index:s_index + page_size])


def _uncovered(name: str) -> Callable[..., NoReturn]:
    def call(*_args: object, **_kwargs: object) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.kvcacheio.{name} is not covered by kvalign's HiCache CPU stand-in "
                                  "(MLA or page_head host layouts): run the real sglang-kernel for this path")

    call.__name__ = name
    return call


for _name in UNCOVERED:
    globals()[_name] = _uncovered(_name)

#: Every name the stand-in binds where SGLang's ``mha.py`` imports ``sgl_kernel.kvcacheio`` on CUDA.
EXPORTS = tuple(sorted({op for pair in MHA_OPS.values() for op in pair} | set(UNCOVERED)))
__all__ = list(EXPORTS)
