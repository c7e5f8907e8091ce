"""Install the stand-in's patches as SGLang's modules load, in every worker process.

Patching at import (a meta-path finder that runs a patch right after its target module
executes) rather than importing SGLang eagerly from ``sitecustomize`` keeps start-up order
exactly SGLang's own: nothing of SGLang is imported before the worker's ``main`` imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from kvalign.standins import hicache_cpu
from kvalign.standins.hicache_cpu import patches as hicache_patches
from kvalign.standins import sglang_scalar_pads
from kvalign.standins.sglang_cpu import SUPPORTED, forkserver, kv_transfer, patches, publisher_faults, version_problem

#: module -> patches to run once it has executed, in every supported release (each release's own
#: extra ones come from ``SUPPORTED[version].patches``).
PATCHES: dict[str, tuple[Callable[[], None], ...]] = {
    "sglang.srt.speculative.draft_utils": (patches.draft_extend_backend,),
    "sglang.srt.layers.attention.torch_native_backend": (patches.target_verify_extend, patches.cpu_graph_seq_len_fill),
    "sglang.srt.layers.rotary_embedding.base": (patches.rotary_empty_batch,),
    "sglang.srt.arg_groups.pd_disaggregation_hook": (patches.fake_transfer_prefill_check,),
    "sglang.srt.managers.disagg_service": (patches.fake_transfer_bootstrap,),
    "sglang.srt.disaggregation.decode": (patches.fake_transfer_decode,),
}

#: The real transfer on CPU (:mod:`.kv_transfer`): SGLang's NIXL path on host memory and its KV checksum,
#: for the releases whose default transfer is ``nixl`` (:attr:`~kvalign.standins.sglang_cpu.Release.transfer`).
TRANSFER_PATCHES: dict[str, tuple[Callable[[], None], ...]] = {
    "sglang.srt.disaggregation.decode": (kv_transfer.arm_checksum_injector, kv_transfer.record_checksum_verifications),
    "sglang.srt.disaggregation.nixl.conn": (kv_transfer.nixl_host_memory, kv_transfer.nixl_progress_thread_waits),
    "sglang.srt.disaggregation.checksum": (kv_transfer.kv_checksum_on_cpu,),
}

#: HiCache's host pool on CPU (:mod:`kvalign.standins.hicache_cpu`), for the releases it supports.
HICACHE_PATCHES: dict[str, tuple[Callable[[], None], ...]] = {
    "sglang.srt.mem_cache.pool_host.common": (hicache_patches.host_register_on_cpu,),
    "sglang.srt.mem_cache.pool_host.mha": (hicache_patches.kvcacheio_on_cpu, hicache_patches.storage_scratch_on_cpu),
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, after: Sequence[Callable[[], None]]) -> None:
        self.inner, self.after = inner, after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        for patch in self.after:
            patch()


def release_patches(version: str) -> dict[str, tuple[Callable[[], None], ...]]:
    """The common patches plus ``version``'s own (HiCache's where :mod:`.hicache_cpu` supports it, the real
    transfer's where the release runs ``nixl``)."""
    table = dict(PATCHES)
    if hicache_cpu.version_problem(version) is None:
        table.update(HICACHE_PATCHES)
    if SUPPORTED[version].transfer == "nixl":
        for module, after in TRANSFER_PATCHES.items():
            table[module] = (*table.get(module, ()), *after)
    for module, name in SUPPORTED[version].patches:
        table[module] = (*table.get(module, ()), getattr(patches, name))
    return table


class PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, table: dict[str, tuple[Callable[[], None], ...]]) -> None:
        self.table = table

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        after = self.table.get(name)
        if after is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, after)
                return spec
        return None


#: PyPI's torchvision is a CUDA build: these two op-registration modules raise beside torch+cpu
#: ("operator torchvision::nms does not exist"); SGLang only needs torchvision's Python parts.
TORCHVISION_SHIM = ("torchvision._meta_registrations", "torchvision._autograd_registrations")


def leave_if(problem: str | None) -> None:
    """Stop a worker process that a stand-in cannot serve, with one line: ``site.py`` would turn a
    ``SystemExit`` raised from ``sitecustomize`` into a traceback."""
    if problem:
        sys.stderr.write(f"kvalign: {problem}\n")
        sys.stderr.flush()
        os._exit(2)


def install() -> None:
    """Refuse a different SGLang, shim torchvision, then patch SGLang's modules as they load."""
    leave_if(version_problem())
    for name in TORCHVISION_SHIM:
        sys.modules.setdefault(name, ModuleType(name))
    if not any(isinstance(f, PatchOnImport) for f in sys.meta_path):
        from importlib import metadata

        table = release_patches(metadata.version("sglang"))
        if os.environ.get(publisher_faults.FAULTS_ENV):  # a test control, never set on the normal path
            module = "sglang.srt.disaggregation.kv_events"
            table[module] = (*table.get(module, ()), publisher_faults.install)
        if os.environ.get(sglang_scalar_pads.ENABLE_ENV) == "1":  # the live multimodal control: 0.5.21's pad rule
            module = "sglang.srt.managers.schedule_batch"
            table[module] = (*table.get(module, ()), sglang_scalar_pads.install_in_module)
        if os.environ.get(forkserver.FORKSERVER_ENV) == "1":  # children forked, not spawned
            module = "sglang.srt.entrypoints.engine"
            table[module] = (*table.get(module, ()), forkserver.forkserver_children)
            # the fork server a fork of the worker, its modules imported and Dynamo's runtime not yet started
            table[forkserver.SERVER_FROM] = (*table.get(forkserver.SERVER_FROM, ()), forkserver.fork_server_before_runtime)
        sys.meta_path.insert(0, PatchOnImport(table))
