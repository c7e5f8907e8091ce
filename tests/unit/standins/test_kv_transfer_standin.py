"""The CPU transfer stand-in (kvalign/standins/sglang_cpu/kv_transfer.py) against SGLang 0.5.23.

* The Adler-32 digest equals an independent one (zlib over the selected items, cut from the tensors
  by numpy) and, on a GPU, SGLang's own CUDA kernel on the same bytes.
* SGLang's ``KvChecksumComputer`` runs on CPU pages through the patch (its selection, order and
  state handling untouched), and a page changed after the digest changes it: the checksum can fail
  on what it guards.
* ``NixlKVManager`` gets ``DRAM`` kinds on a CPU device and keeps SGLang's own elsewhere.
* NIXL's progress thread waits between passes (it spun a core per worker).

Each patch is applied to the installed SGLang and undone after the test (monkeypatch), so nothing
leaks into the oracles that share the worker process.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest

from kvalign.oracles.sglang import _modules  # noqa: E402  # SGLang's import chain behind the torchvision shim
from kvalign.standins.sglang_cpu import kv_transfer  # noqa: E402

torch = pytest.importorskip("torch")
_modules()
checksum = pytest.importorskip("sglang.srt.disaggregation.checksum")


def _pools(seed: int = 0, layers: int = 3, pages: int = 6, page_bytes: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (pages, page_bytes), generator=gen, dtype=torch.uint8) for _ in range(layers)]


def _reference(pools: list[torch.Tensor], pages: list[int]) -> int:
    """zlib's Adler-32 over each pool's selected pages, pools in order: computed without a pointer."""
    digest = 1
    for pool in pools:
        for p in pages:
            digest = zlib.adler32(pool[p].numpy().tobytes(), digest)
    return digest


@pytest.mark.parametrize("pages", [[0], [3, 1, 4], [5, 0, 2, 2]])
def test_digest_is_adler32_of_the_selected_items_in_order(pages):
    pools = _pools()
    idx = torch.tensor(pages, dtype=torch.int64)
    got = kv_transfer.adler32_strided_checksum([p.data_ptr() for p in pools], [p.shape[1] for p in pools], [idx] * len(pools))
    assert got == _reference(pools, pages)


def test_no_item_digests_to_one_as_sglangs_does():
    assert kv_transfer.adler32_strided_checksum([0], [64], [torch.tensor([], dtype=torch.int64)]) == 1


@pytest.fixture
def cpu_checksum(monkeypatch):
    """SGLang's KvChecksumComputer with the stand-in's compute, restored after the test."""
    monkeypatch.setattr(checksum.KvChecksumComputer, "compute", checksum.KvChecksumComputer.compute)
    kv_transfer.kv_checksum_on_cpu()
    return checksum.KvChecksumComputer


def test_sglangs_checksum_runs_on_cpu_pages_and_fails_on_a_changed_page(cpu_checksum):
    pools = _pools(seed=1)
    computer = cpu_checksum(torch.device("cuda:0"), [p.data_ptr() for p in pools], [p.shape[1] for p in pools])
    pages = torch.tensor([2, 3, 4], dtype=torch.int64)
    sent = computer.compute(pages)
    assert sent == _reference(pools, [2, 3, 4])
    assert computer.compute(pages) == sent  # the same bytes verify
    pools[1][3, 7] ^= 0x01  # one bit of one page of one layer
    assert computer.compute(pages) != sent
    pools[1][3, 7] ^= 0x01
    pools[0][5, 0] ^= 0xFF  # a page outside the request's is not its business
    assert computer.compute(pages) == sent


def test_state_pools_are_digested_after_the_kv_pools(cpu_checksum):
    kv, state = _pools(seed=2, layers=2), _pools(seed=3, layers=1)
    computer = cpu_checksum(torch.device("cuda:0"), [p.data_ptr() for p in kv], [64, 64], [state[0].data_ptr()], [64])
    got = computer.compute(torch.tensor([1], dtype=torch.int64), torch.tensor([4], dtype=torch.int64))
    assert got == zlib.adler32(state[0][4].numpy().tobytes(), _reference(kv, [1]))


def test_the_nixl_manager_labels_a_cpu_devices_kv_memory_dram():
    for device, kinds, want in (("cpu", None, ["DRAM"] * 3), ("cpu", ["VRAM"] * 3, ["DRAM"] * 3),
                                ("cuda", None, None), ("cuda", ["VRAM"] * 3, ["VRAM"] * 3)):
        args = SimpleNamespace(kv_data_ptrs=[1, 2, 3], kv_data_mem_kinds=kinds)
        kv_transfer.label_host_memory(args, SimpleNamespace(device=device))
        assert args.kv_data_mem_kinds == want, device
    from sglang.srt.disaggregation.nixl import conn

    # what the label feeds: SGLang's own normaliser accepts DRAM, and its default for an unset kind is VRAM
    assert conn._normalize_kv_mem_kinds(["DRAM"] * 2, 2) == ["DRAM", "DRAM"]
    assert conn._normalize_kv_mem_kinds(None, 2) == ["VRAM", "VRAM"]


def test_nixls_progress_thread_waits_between_passes(monkeypatch):
    """NIXL's Python agent starts its progress thread with no wait (``pthrDelay = 0``: a core spun per
    worker, idle or not); through the patch the agent it creates gets :data:`kv_transfer.PROGRESS_DELAY_US`."""
    from nixl import _api

    monkeypatch.setattr(_api, "nixlBind", _api.nixlBind)
    seen = []
    real = _api.nixlBind.nixlAgent
    monkeypatch.setattr(_api.nixlBind, "nixlAgent", lambda name, config: seen.append(config.pthrDelay) or real(name, config))
    _api.nixl_agent("unpatched", _api.nixl_agent_config(backends=[]))
    kv_transfer.nixl_progress_thread_waits()
    _api.nixl_agent("patched", _api.nixl_agent_config(backends=[]))
    assert seen == [0, kv_transfer.PROGRESS_DELAY_US] and kv_transfer.PROGRESS_DELAY_US > 0


def test_each_patch_finds_the_sglang_code_it_was_written_for(monkeypatch):
    """The source checks hold on the installed SGLang (a changed release stops the worker at start-up)."""
    from sglang.srt.disaggregation import decode
    from sglang.srt.disaggregation.nixl import conn

    mixin = decode.SchedulerDisaggregationDecodeMixin
    monkeypatch.setattr(mixin, "_verify_kv_checksums", mixin._verify_kv_checksums)
    monkeypatch.setattr(conn.NixlKVManager, "__init__", conn.NixlKVManager.__init__)
    monkeypatch.setattr(checksum.KvChecksumComputer, "compute", checksum.KvChecksumComputer.compute)
    monkeypatch.setenv(kv_transfer.CHECKSUM_LEDGER_ENV, "/nonexistent/ledger.jsonl")
    monkeypatch.setenv(kv_transfer.CHECKSUM_INJECTOR_ARM_ENV, "/nonexistent/arm")
    from nixl import _api

    monkeypatch.setattr(_api, "nixlBind", _api.nixlBind)
    for patch in (kv_transfer.nixl_host_memory, kv_transfer.nixl_progress_thread_waits, kv_transfer.kv_checksum_on_cpu,
                  kv_transfer.arm_checksum_injector, kv_transfer.record_checksum_verifications):
        patch()
    assert mixin._verify_kv_checksums.__wrapped__.__wrapped__ is not None  # both decode hooks wrapped SGLang's


@pytest.mark.gpu_1
@pytest.mark.nightly
def test_the_digest_equals_sglangs_cuda_kernel():
    """On a GPU: SGLang's own Adler-32 kernel and the stand-in agree on the same bytes."""
    from sglang.kernels.ops.memory.adler32 import adler32_strided_checksum as original

    pools = _pools(seed=4, layers=4, pages=16, page_bytes=4096)
    idx = [torch.tensor([0, 5, 9, 15], dtype=torch.int64)] * len(pools)
    cpu = kv_transfer.adler32_strided_checksum([p.data_ptr() for p in pools], [4096] * 4, idx)
    cuda = [p.cuda() for p in pools]
    assert original([p.data_ptr() for p in cuda], [4096] * 4, [i.cuda() for i in idx]) == cpu
