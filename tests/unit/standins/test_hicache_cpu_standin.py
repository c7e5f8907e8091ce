"""kvalign's HiCache CPU stand-in held to SGLang's own transfer semantics, with negative controls.

* The torch ops of :mod:`kvalign.standins.hicache_cpu.kvcacheio` against sgl-kernel's own torch
  references (``ref_copy_with_indices`` and ``ref_copy_with_indices_pf_direct``, copied below from
  ``sgl-kernel/tests/test_kvcacheio.py``: the kernels themselves are CUDA-only), on generated pools,
  index sets and layer tables; for the page-first kernel ops the reference runs on the per-layer
  views SGLang's host pool builds for page-first (``k_buffer.transpose(0, 1)[layer]``,
  ``MHATokenToKVPoolHost._initialize_transfer_views``). Mutants that address one byte wrong must fail.
* The kernels' own checks (``TORCH_CHECK``) and their skipping of negative indices.
* :class:`~kvalign.standins.hicache_cpu.pinned.HostRegistry` against the CUDA runtime's documented
  ``cudaHostRegister`` / ``cudaHostUnregister`` contract.
* SGLang's real host pool (``MHATokenToKVPoolHost`` over a real ``MHATokenToKVPool``) in a child
  process with the stand-in loaded as in a worker (the release's child the stand-in's test files share,
  ``standin_child.py``): every covered (io backend, layout) backs device
  pages up, reads them back through SGLang's ``get_data_page`` and loads them into other slots;
  SGLang's own registration code runs against the registry. The same child with a broken op fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import standin_child
from hypothesis import given
from hypothesis import strategies as st
from standin_child import StandinChildren

from kvalign.standins import hicache_cpu, sglang_cpu
from kvalign.standins.hicache_cpu.pinned import ALREADY_REGISTERED, INVALID_VALUE, NOT_REGISTERED, HostRegistry


#: torch and the stand-in's ops (which import it), bound by :func:`_torch` when this file's first test runs
torch: ModuleType
io: ModuleType


@pytest.fixture(scope="module", autouse=True)
def _torch() -> None:
    """Import torch (about 2.2 CPU-s) when these tests run, on a worker that holds it already with SGLang
    (``tests/xdist_scopes.py``), not in every xdist worker's collection. The tests read ``torch`` and
    ``io`` as module names, as if imported at the top."""
    global torch, io
    import torch
    from kvalign.standins.hicache_cpu import kvcacheio as io


# ---- sgl-kernel's torch references (sgl-kernel/tests/test_kvcacheio.py, copied as written) ----------

def ref_copy_with_indices(src_pool, dst_pool, src_indices, dst_indices):
    dst_pool[dst_indices] = src_pool[src_indices].to(dst_pool.device)


def ref_copy_with_indices_pf_direct(src_pool, dst_pool, src_indices, dst_indices, page_size, layer_id, lf_to_pf=False):
    if lf_to_pf:
        for i in range(0, len(src_indices), page_size):
            dst_pool[dst_indices[i] // page_size][layer_id] = src_pool[layer_id][
                src_indices[i : i + page_size]
            ].to(dst_pool.device)
    else:
        for i in range(0, len(src_indices), page_size):
            dst_pool[layer_id][dst_indices[i : i + page_size]] = src_pool[
                src_indices[i] // page_size
            ][layer_id].to(dst_pool.device)


# ---- generated geometry -----------------------------------------------------------------------

@st.composite
def geometries(draw):
    """(layers, pages in the pool, page size, row shape, dtype, source pages, destination pages)."""
    layers = draw(st.integers(1, 4))
    page = draw(st.sampled_from([1, 2, 4]))
    pages = draw(st.integers(4, 10))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    row = (draw(st.integers(1, 2)), 4 if dtype == torch.float32 else 8)  # heads x dim: item bytes % 8 == 0
    n = draw(st.integers(1, pages // 2))
    perm = draw(st.permutations(range(pages)))
    return layers, pages, page, row, dtype, list(perm[:n]), list(perm[n:2 * n])


def _indices(pages: list[int], page: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages]).to(torch.int64)


def _item(row: tuple[int, int], dtype: torch.dtype) -> int:
    return row[0] * row[1] * dtype.itemsize


def _rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _table(t: torch.Tensor) -> torch.Tensor:
    """A layer table as SGLang builds one (``make_kernel_ptr_table``): uint64 data pointers."""
    return torch.tensor([t[i].data_ptr() for i in range(t.shape[0])], dtype=torch.uint64)


@given(geometries())
def test_transfer_kv_per_layer_is_the_reference_copy(count_case, g):
    count_case()
    layers, pages, page, row, dtype, src_p, dst_p = g
    size = pages * page
    src_k, src_v = _rand(layers, size, *row, dtype=dtype), _rand(layers, size, *row, dtype=dtype)
    dst_k, dst_v = torch.zeros_like(src_k), torch.zeros_like(src_v)
    ref_k, ref_v = torch.zeros_like(src_k), torch.zeros_like(src_v)
    s, d = _indices(src_p, page), _indices(dst_p, page)
    layer = layers - 1
    io.transfer_kv_per_layer(src_k[layer], dst_k[layer], src_v[layer], dst_v[layer], s, d, _item(row, dtype))
    ref_copy_with_indices(src_k[layer], ref_k[layer], s, d)
    ref_copy_with_indices(src_v[layer], ref_v[layer], s, d)
    assert torch.equal(dst_k, ref_k) and torch.equal(dst_v, ref_v)


@given(geometries())
def test_transfer_kv_all_layer_through_layer_tables_is_the_reference_copy(count_case, g):
    count_case()
    layers, pages, page, row, dtype, src_p, dst_p = g
    size = pages * page
    src_k, src_v = _rand(layers, size, *row, dtype=dtype), _rand(layers, size, *row, dtype=dtype)
    dst_k, dst_v = torch.zeros_like(src_k), torch.zeros_like(src_v)
    s, d = _indices(src_p, page), _indices(dst_p, page)
    io.transfer_kv_all_layer(_table(src_k), _table(dst_k), _table(src_v), _table(dst_v), s, d, _item(row, dtype), layers)
    ref_k, ref_v = torch.zeros_like(src_k), torch.zeros_like(src_v)
    for layer in range(layers):
        ref_copy_with_indices(src_k[layer], ref_k[layer], s, d)
        ref_copy_with_indices(src_v[layer], ref_v[layer], s, d)
    assert torch.equal(dst_k, ref_k) and torch.equal(dst_v, ref_v)


@given(geometries())
def test_page_first_kernel_ops_are_the_reference_copy_on_sglangs_page_first_views(count_case, g):
    count_case()
    """Device (layer-first, per-layer tables) -> host page-first ``[size, layer, heads, dim]`` and back
    one layer at a time: the reference copy on the views SGLang's host pool addresses page-first
    memory through (``k_buffer.transpose(0, 1)[layer]``)."""
    layers, pages, page, row, dtype, src_p, dst_p = g
    size, item = pages * page, _item(row, dtype)
    dev_k, dev_v = _rand(layers, size, *row, dtype=dtype), _rand(layers, size, *row, dtype=dtype)
    host_k, host_v = torch.zeros(size, layers, *row, dtype=dtype), torch.zeros(size, layers, *row, dtype=dtype)
    s, d = _indices(src_p, page), _indices(dst_p, page)
    io.transfer_kv_all_layer_lf_pf(_table(dev_k), host_k, _table(dev_v), host_v, s, d, item, item * layers, layers)
    ref_k, ref_v = torch.zeros_like(host_k), torch.zeros_like(host_v)
    for layer in range(layers):
        ref_copy_with_indices(dev_k[layer], ref_k.transpose(0, 1)[layer], s, d)
        ref_copy_with_indices(dev_v[layer], ref_v.transpose(0, 1)[layer], s, d)
    assert torch.equal(host_k, ref_k) and torch.equal(host_v, ref_v)
    back_k, back_v = torch.zeros_like(dev_k), torch.zeros_like(dev_v)
    for layer in range(layers):
        io.transfer_kv_per_layer_pf_lf(host_k, back_k[layer], host_v, back_v[layer], d, s, layer, item, item * layers)
    assert torch.equal(back_k[:, s], dev_k[:, s]) and torch.equal(back_v[:, s], dev_v[:, s])


@given(geometries())
def test_direct_ops_are_the_reference_copies(count_case, g):
    count_case()
    layers, pages, page, row, dtype, src_p, dst_p = g
    size = pages * page
    dev = [_rand(size, *row, dtype=dtype) for _ in range(2 * layers)]  # k layers, then v layers
    s, d = _indices(src_p, page), _indices(dst_p, page)
    host = [torch.zeros_like(t) for t in dev]
    io.transfer_kv_direct(dev, host, s, d, page)
    for src, dst in zip(dev, host):
        ref = torch.zeros_like(src)
        ref_copy_with_indices(src, ref, s, d)
        assert torch.equal(dst, ref)
    pf = [torch.zeros(pages, layers, page, *row, dtype=dtype) for _ in range(2)]  # page_first_direct host k, v
    io.transfer_kv_all_layer_direct_lf_pf(dev, pf, s, d, page)
    for kv in range(2):
        ref = torch.zeros_like(pf[kv])
        for layer in range(layers):
            ref_copy_with_indices_pf_direct(torch.stack(dev[kv * layers:(kv + 1) * layers]), ref, s, d, page, layer,
                                            lf_to_pf=True)
        assert torch.equal(pf[kv], ref)
    layer = layers - 1
    out = [torch.zeros(layers, size, *row, dtype=dtype) for _ in range(2)]
    io.transfer_kv_per_layer_direct_pf_lf(pf, [out[0][layer], out[1][layer]], d, s, layer, page)
    for kv in range(2):
        ref = torch.zeros_like(out[kv])
        ref_copy_with_indices_pf_direct(pf[kv], ref, d, s, page, layer, lf_to_pf=False)
        assert torch.equal(out[kv], ref)


# ---- negative controls: a wrong address anywhere must show ------------------------------------

def _pf_wrong_layer(src_k_layers, dst_k, src_v_layers, dst_v, s, d, item, layout_dim, layers):
    io._launch(item, s, d, range(layers), [(io._tbl(src_k_layers, item), io._pf(dst_k, layout_dim, 0)),
                                           (io._tbl(src_v_layers, item), io._pf(dst_v, layout_dim, 0))])


def _pf_k_for_v(src_k_layers, dst_k, src_v_layers, dst_v, s, d, item, layout_dim, layers):
    io.transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_k_layers, dst_v, s, d, item, layout_dim, layers)


def _pf_half_item(src_k_layers, dst_k, src_v_layers, dst_v, s, d, item, layout_dim, layers):
    io.transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, s, d, item // 2, layout_dim, layers)


@pytest.mark.parametrize("mutant", [_pf_wrong_layer, _pf_k_for_v, _pf_half_item], ids=lambda f: f.__name__[1:])
def test_negative_control_a_misaddressed_copy_fails_the_reference(mutant):
    layers, page, size, row, dtype = 3, 2, 16, (2, 4), torch.float32
    item = _item(row, dtype)
    torch.manual_seed(1)
    dev_k, dev_v = _rand(layers, size, *row, dtype=dtype), _rand(layers, size, *row, dtype=dtype)
    s, d = _indices([5, 1], page), _indices([2, 6], page)
    ref_k, ref_v = torch.zeros(size, layers, *row), torch.zeros(size, layers, *row)
    for layer in range(layers):
        ref_copy_with_indices(dev_k[layer], ref_k.transpose(0, 1)[layer], s, d)
        ref_copy_with_indices(dev_v[layer], ref_v.transpose(0, 1)[layer], s, d)
    got_k, got_v = torch.zeros_like(ref_k), torch.zeros_like(ref_v)
    io.transfer_kv_all_layer_lf_pf(_table(dev_k), got_k, _table(dev_v), got_v, s, d, item, item * layers, layers)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)  # the stand-in itself passes
    bad_k, bad_v = torch.zeros_like(ref_k), torch.zeros_like(ref_v)
    mutant(_table(dev_k), bad_k, _table(dev_v), bad_v, s, d, item, item * layers, layers)
    assert not (torch.equal(bad_k, ref_k) and torch.equal(bad_v, ref_v))


# ---- the kernels' own rules ---------------------------------------------------------------------

def test_a_pair_with_a_negative_index_is_skipped_as_the_kernel_skips_it():
    src, dst = torch.arange(32, dtype=torch.float32).reshape(8, 4), torch.zeros(8, 4)
    io.transfer_kv_per_layer(src, dst, src.clone(), torch.zeros(8, 4), torch.tensor([1, -1, 3]),
                             torch.tensor([0, 2, -1]), 16)
    assert torch.equal(dst[0], src[1]) and not dst[1:].any()


@pytest.mark.parametrize("call, message", [
    (lambda t, i: io.transfer_kv_per_layer(t, t, t, t, i, i, 12), "Item byte size must be divisible by 8"),
    (lambda t, i: io.transfer_kv_per_layer(t, t, t, t, i.int(), i, 16), "Source indices must be of type long"),
    (lambda t, i: io.transfer_kv_per_layer(t, t, t, t, i, i[:1], 16), "must have the same length"),
    (lambda t, i: io.transfer_kv_all_layer(i.to(torch.uint64), i.to(torch.uint64), i.to(torch.uint64),
                                           i.to(torch.uint64), i, i, 16, 3), "does not match num_layers"),
    (lambda t, i: io.transfer_kv_direct([t], [t], i, i[:1], 1), "must have the same length"),
    (lambda t, i: io.transfer_kv_direct([t], [t], i, i, 4), "divisible by page size"),
])
def test_the_kernels_checks_raise_as_torch_check_does(call, message):
    with pytest.raises(RuntimeError, match=message):
        call(torch.zeros(8, 4), torch.tensor([0, 1], dtype=torch.int64))


def test_uncovered_ops_raise_naming_themselves():
    for name in io.UNCOVERED:
        with pytest.raises(NotImplementedError, match=f"sgl_kernel.kvcacheio.{name} is not covered"):
            getattr(io, name)()


# ---- pinned allocation ----------------------------------------------------------------------------

def test_host_registry_keeps_the_cuda_runtime_contract():
    r = HostRegistry()
    assert r.cudaHostRegister(0x1000, 256, 0) == 0
    assert r.cudaHostRegister(0x1080, 16, 0) == ALREADY_REGISTERED  # any overlap
    assert r.cudaHostRegister(0x0F00, 0x101, 0) == ALREADY_REGISTERED
    assert r.cudaHostRegister(0x1100, 16, 0) == 0  # adjacent is fine
    assert r.cudaHostRegister(0, 16, 0) == INVALID_VALUE and r.cudaHostRegister(0x9000, 0, 0) == INVALID_VALUE
    assert r.cudaHostUnregister(0x1080) == NOT_REGISTERED  # not a registered base
    assert r.cudaHostUnregister(0x1000) == 0 and r.cudaHostUnregister(0x1000) == NOT_REGISTERED
    assert r.registered() == {0x1100: 16}
    assert r.cudaGetErrorString(ALREADY_REGISTERED) == "part or all of the requested memory range is already mapped"


def test_negative_control_a_registry_without_the_overlap_rule_is_caught():
    class Lax(HostRegistry):
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
            return 0

    assert Lax().cudaHostRegister(0x1000, 256, 0) == 0 and Lax().cudaHostRegister(0x1000, 256, 0) == 0
    r = HostRegistry()
    r.cudaHostRegister(0x1000, 256, 0)
    assert r.cudaHostRegister(0x1000, 256, 0) != 0


# ---- SGLang's real host pool, in a worker-like child ---------------------------------------------

@pytest.fixture(scope="module", params=hicache_cpu.SUPPORTED)
def release(request: pytest.FixtureRequest) -> tuple[str, Path | None]:
    """Each release the stand-in supports and where it is: the environment's (None), or its wheel-cache directory."""
    from kvalign.verify.report.matrix import MatrixError, ensure_release

    if request.param == sglang_cpu.SGLANG_VERSION:
        return request.param, None
    try:
        return request.param, ensure_release("sglang", request.param)
    except MatrixError as exc:
        pytest.skip(f"sglang {request.param} cannot be installed into the wheel cache here: {exc}")


#: The negative control's broken ops, run by the environment's release child after its round trips
MUTANTS = ("pf_without_layer", "k_for_v")


def _pool_child_code(release: str) -> str:
    """:mod:`hicache_pool_child` in the release's shared child: its round trips and registration, and in the
    environment's release then each of :data:`MUTANTS` in turn (the control), on pools of their own, each op put
    back before the next."""
    argv = ["--mutants", *MUTANTS] if release == sglang_cpu.SGLANG_VERSION else []
    return f"import json, hicache_pool_child\nprint(json.dumps(hicache_pool_child.collect({argv!r})))\n"


#: One child per release imports SGLang's memory pools for both tests, and it is the release's child that the
#: other stand-in files share (:mod:`standin_child`): each test here used to start its own (about 10 CPU-s
#: apiece). The pools run after those files' import checks, which want a fresh interpreter.
standin_child.add("hicache_pools", _pool_child_code, hicache_cpu.SUPPORTED, imports_first=False)


def _pools(standin_children: StandinChildren, version: str, where: Path | None) -> dict:
    return json.loads(standin_children.section(version, where, "hicache_pools").strip().splitlines()[-1])


@pytest.mark.slow  # the release's shared child imports SGLang's memory pools (about 10 s per release)
def test_sglangs_host_pool_backs_up_and_loads_back_through_the_stand_in(release, standin_children):
    out = _pools(standin_children, *release)
    for key in ("kernel/page_first", "kernel/layer_first", "direct/layer_first", "direct/page_first_direct"):
        assert out[key] == {"backed_up": [True, True, True], "loaded_back": True, "other_slots_untouched": True}, key
    reg = out["registration"]
    assert reg["registered"] and reg["released"] and not reg["cuda_elsewhere"]
    assert reg["second_register"] == ("cudaHostRegister failed (rc=712, part or all of the requested memory range "
                                      "is already mapped")


@pytest.mark.slow
def test_negative_control_sglangs_round_trip_fails_on_a_broken_op(standin_children):
    out = _pools(standin_children, sglang_cpu.SGLANG_VERSION, None)["mutants"]
    assert out["pf_without_layer"]["backed_up"] == [False, False, False], out  # every layer at layer 0's offset
    assert out["k_for_v"]["backed_up"] == [True, True, True] and out["k_for_v"]["loaded_back"] is False, out
