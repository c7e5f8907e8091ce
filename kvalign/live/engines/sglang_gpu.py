"""The real-engine GPU worker kind: ``python -m dynamo.sglang`` on CUDA with kvalign's tiny models.

The same Dynamo worker, SGLang scheduler, EAGLE3 decoder, radix cache and KV-event publisher as the
CPU kind (:mod:`.sglang_cpu`, whose command it shares), on SGLang's CUDA path: ``--device cuda
--attention-backend triton --dtype bfloat16``, the kernels of ``sglang-kernel`` 0.4.5, CUDA graphs
off unless asked for, and HiCache (where asked) on SGLang's own pinned host memory and ``kvcacheio``
kernels: no CPU stand-in is loaded. What it adds to SGLang is :mod:`kvalign.standins.sglang_gpu`.

Settings and why:

* the tiny target and EAGLE3 draft of :mod:`.engine_model` in :data:`~.engine_model.GPU` shapes,
  written on the machine (no model hub there): nothing to download; prefill hands the KV to decode
  over SGLang's NIXL backend (``nixl-cu13`` from the GPU bundle, VRAM between the processes on one
  GPU) with SGLang's KV checksum on both sides, ``--transfer fake`` being the decode half's control;
* EAGLE3 as Dynamo's EAGLE tests run it (:class:`~.sglang_worker.EagleConfig`: 3 steps, top-k 1,
  4 draft tokens): the CUDA path has the multi-step draft backend the CPU one lacks;
* ``--mem-fraction-static`` split between the workers sharing a GPU (:func:`mem_fraction`), the KV
  pool itself capped by ``--max-total-tokens`` as on CPU;
* ``--disable-overlap-schedule``, as on CPU: the live checks read the same schedule on both.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvalign.live.cluster.lifecycle import make_plan
from kvalign.live.cluster.topology import ClusterPlan, ControlPlane, Topology, WorkerSpec
from kvalign.live.engines.engine_model import GPU, TARGET_NAME, Draft, Pair, write_models
from kvalign.live.engines.hicache import HiCache
from kvalign.live.engines.sglang_cpu import SglangCpuWorkerKind
from kvalign.live.engines.sglang_worker import GPU_MEMORY_BUDGET, EagleConfig
from kvalign.standins import sglang_gpu as sglang_gpu_standin


def mem_fraction(worker: WorkerSpec, plan: ClusterPlan) -> float:
    """SGLang's static-memory budget split evenly between the workers sharing ``worker``'s GPU."""
    sharing = sum(1 for w in plan.topology.workers if (w.gpu or 0) == (worker.gpu or 0))
    return int(GPU_MEMORY_BUDGET / sharing * 100) / 100


class SglangGpuWorkerKind(SglangCpuWorkerKind):
    """Builds each worker's real ``dynamo.sglang`` command on CUDA (a :class:`WorkerKind`)."""

    name = "sglang-gpu"

    def __init__(self, draft_model: str | None, *, eagle: EagleConfig = EagleConfig(), cuda_graph: bool = False,
                 hicache: HiCache | None = None, transfer: str = "nixl", checksum_injector: bool = False,
                 **settings: Any) -> None:
        """``settings``: the CPU kind's worker settings (pools, event format, recording)."""
        super().__init__(draft_model, sglang_version=sglang_gpu_standin.SGLANG_VERSION, hicache=hicache,
                         transfer=transfer, checksum_injector=checksum_injector, **settings)
        self.eagle, self.cuda_graph = eagle, cuda_graph

    def device_args(self, worker: WorkerSpec, plan: ClusterPlan) -> list[str]:
        return ["--device", "cuda", "--attention-backend", "triton", "--dtype", "bfloat16",
                "--mem-fraction-static", f"{mem_fraction(worker, plan):g}",
                *([] if self.cuda_graph else ["--disable-cuda-graph"]), "--disable-overlap-schedule"]

    def decode_args(self) -> list[str]:
        return []

    def transfer_env(self, worker: WorkerSpec, plan: ClusterPlan) -> dict[str, str]:
        """The CPU kind's, less its UCX restriction to TCP: on a GPU, NIXL's UCX picks ``cuda_ipc`` /
        ``cuda_copy`` between two processes on one device."""
        env = super().transfer_env(worker, plan)
        env.pop("UCX_TLS", None)
        return env

    def device_env(self, worker: WorkerSpec) -> dict[str, str]:
        return {**sglang_gpu_standin.worker_env(os.environ.get("PYTHONPATH") or None),
                "CUDA_VISIBLE_DEVICES": str(worker.gpu or 0)}


def plan_cluster(topology: Topology, run_dir: str | Path, *, draft: Draft = "agree",
                 control_plane: ControlPlane = "file", hicache: HiCache | None = None,
                 cuda_graph: bool = False, pair: Pair = "zero-head", transfer: str = "nixl",
                 checksum_mismatch_prob: float = 0.0) -> tuple[ClusterPlan, SglangGpuWorkerKind]:
    """Plan a real-engine GPU run with the kind's default worker settings (:func:`plan_engine`)."""
    plan, kind = plan_engine(topology, run_dir, draft=draft, control_plane=control_plane, hicache=hicache,
                             cuda_graph=cuda_graph, pair=pair, transfer=transfer,
                             checksum_mismatch_prob=checksum_mismatch_prob)
    return plan, kind()


def plan_engine(topology: Topology, run_dir: str | Path, *, draft: Draft = "agree",
                control_plane: ControlPlane = "file", hicache: HiCache | None = None,
                cuda_graph: bool = False, pair: Pair = "zero-head", transfer: str = "nixl",
                checksum_mismatch_prob: float = 0.0) -> tuple[ClusterPlan, Callable[..., SglangGpuWorkerKind]]:
    """Plan a real-engine GPU run: the tiny models (GPU shapes, bf16) are written under
    ``run_dir/models`` and served as :data:`TARGET_NAME`; the kind comes back unbuilt, as from
    :func:`.sglang_cpu.plan_engine`."""
    run = Path(run_dir).resolve()
    target, draft_dir = write_models(run / "models", draft, GPU, pair=pair)
    plan = make_plan(topology, run, str(target), model_name=TARGET_NAME, control_plane=control_plane)
    return plan, partial(SglangGpuWorkerKind, str(draft_dir), hicache=hicache, cuda_graph=cuda_graph, transfer=transfer,
                         checksum_injector=checksum_mismatch_prob > 0)


def engine_problem() -> str | None:
    """Why the real SGLang engine cannot run on a GPU here (None when it can): the GPUs, a CUDA torch,
    the bundled SGLang and kernel releases the stand-in was written for."""
    from kvalign.live.engines.gpu import gpu_problem, sglang_cuda_problem, visible_gpus

    gpus, why_none = visible_gpus()
    return gpu_problem(1, gpus, why_none) or sglang_cuda_problem() or sglang_gpu_standin.version_problem()
