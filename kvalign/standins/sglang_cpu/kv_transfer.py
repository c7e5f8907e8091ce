"""A real prefill->decode KV transfer on CPU: SGLang's NIXL backend over host memory, and SGLang's
own KV checksum with its Adler-32 kernel stood in on the CPU.

Written for SGLang 0.5.23 with ``nixl`` / ``nixl-cu12`` 1.5.1 (UCX bundled); each patch first
checks that the SGLang code it targets still reads as expected, so a changed release stops the
worker at start-up with the reason.

Two things stand between SGLang's NIXL path and a CPU-only machine, and nothing else does on the
dense path (``../shared/docs/reference/disagg-transfer.md``):

* :func:`nixl_host_memory` — ``NixlKVManager`` labels KV memory ``VRAM`` whenever no kind is set
  (prefill never sets one; decode sets ``VRAM`` itself, ``decode.py`` ~629-669), and UCX refuses to
  register host memory as ``VRAM`` ("VRAM memory is detected as host by UCX"). On a CPU device
  the kinds are normalised to ``DRAM`` before the manager registers them; the transfer itself is
  SGLang's and NIXL's, untouched (UCX over TCP on 127.0.0.1).
* :func:`kv_checksum_on_cpu` — ``--disaggregation-enable-kv-checksum`` digests each request's KV
  pages on prefill and verifies them on decode (``disaggregation/checksum.py``), with a CUDA-only
  Adler-32 kernel (``kernels/ops/memory/adler32.py``) and ``is_cuda`` asserts. The selection of
  pages and state, the order, the comparison and the abort on mismatch stay SGLang's; only the
  digest of the selected bytes runs here, as :func:`adler32_strided_checksum` — the same value the
  kernel's ordered combine defines (Adler-32 of the items concatenated in order; 1 when empty).

And one thing stands between it and a machine the size of CI's: :func:`nixl_progress_thread_waits`
— NIXL's progress thread, which never waits as NIXL's Python agent creates it, waits 1 ms between
passes, so a NIXL worker no longer spins a core at rest.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import zlib
from collections.abc import Sequence
from typing import Any

from kvalign.standins.sglang_cpu.patches import _require


def adler32_strided_checksum(data_ptrs: Sequence[int], strides: Sequence[int], indices: Sequence[Any]) -> int:
    """Adler-32 of item ``idx`` of each tensor (``base + idx * stride``, ``stride`` bytes), tensors in
    order and each tensor's items in index order: what SGLang's ``adler32_strided_checksum`` returns
    for host memory (its kernel combines per-item states left to right; no item at all gives 1)."""
    digest = 1
    for base, stride, idx in zip(data_ptrs, strides, indices):
        for i in idx.reshape(-1).tolist():
            item = (ctypes.c_ubyte * stride).from_address(int(base) + int(i) * int(stride))
            digest = zlib.adler32(memoryview(item), digest)
    return digest


def kv_checksum_on_cpu() -> None:
    """``KvChecksumComputer.compute`` on CPU index tensors, with the digest of :func:`adler32_strided_checksum`."""
    from sglang.srt.disaggregation import checksum

    computer = checksum.KvChecksumComputer
    original = computer.compute
    source = inspect.getsource(original)
    _require("kv_page_indices_gpu.is_cuda" in source and "adler32_strided_checksum(all_ptrs, all_lens, all_indices)" in source,
             "KvChecksumComputer.compute no longer asserts CUDA indices and digests (ptrs, lens, indices)")

    @functools.wraps(original)
    def compute(self: Any, kv_page_indices_gpu: Any, state_indices_gpu: Any = None) -> int:
        if kv_page_indices_gpu.is_cuda:
            return original(self, kv_page_indices_gpu, state_indices_gpu)
        ptrs, lens = list(self._kv_data_ptrs), list(self._kv_item_lens)
        indices = [kv_page_indices_gpu.contiguous()] * len(ptrs)
        if self._state_data_ptrs:
            _require(state_indices_gpu is not None, "a state pool without state indices")
            ptrs += self._state_data_ptrs
            lens += self._state_item_lens
            indices += [state_indices_gpu.contiguous()] * len(self._state_data_ptrs)
        return adler32_strided_checksum(ptrs, lens, indices)

    computer.compute = compute


def nixl_host_memory() -> None:
    """``NixlKVManager`` registers and transfers a CPU device's KV memory as ``DRAM``."""
    from sglang.srt.disaggregation.nixl import conn

    manager = conn.NixlKVManager
    original = manager.__init__
    _require("_normalize_kv_mem_kinds(" in inspect.getsource(original) and conn.KV_MEM_KINDS == {"VRAM", "DRAM"},
             "NixlKVManager.__init__ no longer normalises kv_data_mem_kinds")

    @functools.wraps(original)
    def __init__(self: Any, args: Any, disaggregation_mode: Any, server_args: Any, *rest: Any, **kwargs: Any) -> None:
        label_host_memory(args, server_args)
        original(self, args, disaggregation_mode, server_args, *rest, **kwargs)

    manager.__init__ = __init__


#: How long NIXL's progress thread waits between passes over its UCX workers (microseconds).
#: NIXL's Python agent hard-codes 0 (``nixl_agent.__init__``: ``agent_config.pthrDelay = 0``): the
#: thread then never waits, and every prefill and decode worker spins a core on it even while the
#: scheduler sleeps (``--sleep-on-idle``). A millisecond is far below one request's transfer here
#: (12-20 ms on loopback) and lets the thread sleep between passes.
PROGRESS_DELAY_US = 1000


def nixl_progress_thread_waits() -> None:
    """NIXL's agents (created by ``NixlKVManager``) start their progress thread with a
    :data:`PROGRESS_DELAY_US` wait between passes instead of none; what moves, and how, stays NIXL's."""
    from nixl import _api

    bind = _api.nixlBind
    _require(hasattr(bind, "nixlAgent") and "agent_config.pthrDelay = 0" in inspect.getsource(_api.nixl_agent.__init__),
             "nixl_agent.__init__ no longer sets the progress thread's delay (pthrDelay) to 0 before creating its agent")

    class _Bindings:
        """``nixlBind`` as ``nixl._api`` reads it, but for the agent's progress delay."""

        def __getattr__(self, name: str) -> Any:
            return getattr(bind, name)

        @staticmethod
        def nixlAgent(name: str, config: Any) -> Any:  # noqa: N802 - NIXL's own name
            config.pthrDelay = PROGRESS_DELAY_US
            return bind.nixlAgent(name, config)

    _api.nixlBind = _Bindings()


def label_host_memory(args: Any, server_args: Any) -> None:
    """On a CPU device every KV buffer SGLang hands NIXL is host memory: label it ``DRAM`` (whatever
    SGLang set or left unset); on any other device leave SGLang's labels as they are."""
    if str(getattr(server_args, "device", "")) == "cpu":
        args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)


#: Set in a decode worker's environment (CPU or GPU) to a file path: each request whose KV SGLang's
#: checksum verified (or rejected) appends one JSON line there. SGLang counts only failures
#: (``sglang:num_transfer_failed_reqs_total``); a run that claims "verified on every request" needs
#: the verifications themselves.
CHECKSUM_LEDGER_ENV = "KVALIGN_KV_CHECKSUM_LEDGER"


def record_checksum_verifications() -> None:
    """Append one line per request that ``_verify_kv_checksums`` verified: its room, rid, pages and
    whether it stayed in the batch (a mismatch is filtered out and aborted by SGLang itself)."""
    import json
    import os

    from sglang.srt.disaggregation import decode

    path = os.environ.get(CHECKSUM_LEDGER_ENV)
    if not path:
        return
    mixin = decode.SchedulerDisaggregationDecodeMixin
    original = mixin._verify_kv_checksums
    source = inspect.getsource(original)
    _require("req.expected_kv_checksum = 0" in source and "batch.filter_batch(" in source and "is_health_check_req" in source,
             "_verify_kv_checksums no longer clears expected_kv_checksum and filters mismatches out of the batch")

    @functools.wraps(original)
    def _verify_kv_checksums(self: Any, batch: Any) -> None:
        if self.kv_checksum_computer is None:
            return original(self, batch)
        due = [(req.rid, req.bootstrap_room, len(req.origin_input_ids) - req.kv.cache_protected_len)
               for req in batch.reqs if req.expected_kv_checksum != 0 and not decode.is_health_check_req(req)]
        original(self, batch)
        kept = {req.rid for req in batch.reqs}
        if due:
            with open(path, "a", encoding="utf-8") as out:
                for rid, room, tokens in due:
                    out.write(json.dumps({"rid": rid, "bootstrap_room": room, "tokens": tokens,
                                          "verified": rid in kept}) + "\n")

    mixin._verify_kv_checksums = _verify_kv_checksums


#: A test control, set only when a run asks for SGLang's checksum-mismatch injector: the file whose
#: content (a probability) arms ``SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB`` in the decode worker
#: once the cluster is up. Set at start, SGLang's injector would fail the harness's readiness request
#: too and the cluster would never come up; armed later, every request after it meets SGLang's own
#: injector and SGLang's own abort.
CHECKSUM_INJECTOR_ARM_ENV = "KVALIGN_KV_CHECKSUM_INJECTOR_ARM"
MISMATCH_PROB_ENV = "SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB"


def arm_checksum_injector() -> None:
    """Before each ``_verify_kv_checksums``, copy the arm file's probability into SGLang's injector
    variable (read by SGLang on every call); nothing while the file does not exist."""
    import os
    from pathlib import Path

    from sglang.srt.disaggregation import decode

    arm = os.environ.get(CHECKSUM_INJECTOR_ARM_ENV)
    if not arm:
        return
    mixin = decode.SchedulerDisaggregationDecodeMixin
    original = mixin._verify_kv_checksums
    _require(f"envs.{MISMATCH_PROB_ENV}.get()" in inspect.getsource(original),
             f"_verify_kv_checksums no longer reads {MISMATCH_PROB_ENV} on each call")

    @functools.wraps(original)
    def _verify_kv_checksums(self: Any, batch: Any) -> None:
        path = Path(arm)
        if path.exists():
            os.environ[MISMATCH_PROB_ENV] = path.read_text(encoding="utf-8").strip()
        return original(self, batch)

    mixin._verify_kv_checksums = _verify_kv_checksums
