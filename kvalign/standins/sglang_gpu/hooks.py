"""Install the GPU stand-in in every worker process: the module it replaces and the patches it runs.

A meta-path finder serves :mod:`.cutedsl_dual_gemm` under SGLang's module name (nothing of SGLang is
imported early), and the CPU stand-in's patch-on-import finder runs the fake-transfer patches right
after their target modules execute.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from typing import Any

from kvalign.standins.sglang_cpu import kv_transfer, patches
from kvalign.standins.sglang_cpu.hooks import PatchOnImport, leave_if
from kvalign.standins.sglang_gpu import cutedsl_dual_gemm, version_problem

#: SGLang's module -> kvalign's file that stands in for it.
REPLACED = {"sglang.kernels.ops.gemm.cutedsl_dual_gemm": cutedsl_dual_gemm.__file__}

#: The fake transfer backend's gaps (SGLang's, not the CPU's): see :mod:`kvalign.standins.sglang_cpu.patches`.
PATCHES = {
    "sglang.srt.arg_groups.pd_disaggregation_hook": (patches.fake_transfer_prefill_check,),
    "sglang.srt.managers.disagg_service": (patches.fake_transfer_bootstrap,),
    "sglang.srt.disaggregation.decode": (patches.fake_transfer_decode, kv_transfer.arm_checksum_injector,
                                         kv_transfer.record_checksum_verifications),
}


class Replace(importlib.abc.MetaPathFinder):
    """Loads each module of :data:`REPLACED` from kvalign's stand-in file instead of SGLang's."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        where = REPLACED.get(name)
        return None if where is None else importlib.util.spec_from_file_location(name, where)


def install() -> None:
    """Refuse another SGLang or kernel release, then replace and patch SGLang's modules as they load."""
    leave_if(version_problem())
    if not any(isinstance(f, Replace) for f in sys.meta_path):
        sys.meta_path[:0] = [Replace(), PatchOnImport(dict(PATCHES))]
