"""What the live GPU layer needs, and a precise reason for each thing that is missing.

The gpu_2 nightly must never pass vacuously and never fail for an environment reason: it
skips, naming every missing prerequisite at once (GPUs, a CUDA build of torch under SGLang,
an importable ``dynamo.sglang``, the model and draft weights), so one read of the skip line
tells the operator what to install. Checks are ordered cheapest first and use no network.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvalign.live.engines.sglang_worker import TINY_MODEL


@dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU as ``nvidia-smi`` lists it."""

    index: int
    uuid: str
    name: str
    memory_mib: int

    def __str__(self) -> str:
        return f"{self.index}: {self.name}, {self.memory_mib} MiB"


NVIDIA_SMI_QUERY = ["--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Rows of ``nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits``."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            raise ValueError(f"unexpected nvidia-smi row: {line!r}")
        index, uuid, name, mem = parts
        gpus.append(Gpu(int(index), uuid, name, int(float(mem))))
    return gpus


def filter_visible(gpus: Sequence[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs a CUDA process sees under ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs).

    As CUDA does: unset means all; an empty value or an invalid entry hides that entry and
    everything after it.
    """
    if cuda_visible_devices is None:
        return list(gpus)
    out = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        match = next((g for g in gpus if entry and (entry == str(g.index) or g.uuid.startswith(entry))), None)
        if match is None or match in out:
            break
        out.append(match)
    return out


def visible_gpus(
    env: dict[str, str] | None = None, run: Callable[..., subprocess.CompletedProcess] = subprocess.run
) -> tuple[list[Gpu], str | None]:
    """Visible GPUs, and why there are none when the list is empty."""
    env = dict(os.environ) if env is None else env
    exe = shutil.which("nvidia-smi", path=env.get("PATH"))
    if exe is None:
        return [], "nvidia-smi not found (no NVIDIA driver on this machine)"
    try:
        proc = run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"nvidia-smi failed: {exc}"
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return [], f"nvidia-smi exited {proc.returncode}: {lines[-1] if lines else 'no output'}"
    gpus = filter_visible(parse_nvidia_smi(proc.stdout), env.get("CUDA_VISIBLE_DEVICES"))
    if not gpus:
        return [], f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r} hides every GPU"
    return gpus, None


def gpu_problem(needed: int, gpus: Sequence[Gpu], why_none: str | None) -> str | None:
    if len(gpus) >= needed:
        return None
    seen = "none visible" if not gpus else f"{len(gpus)} visible ({'; '.join(map(str, gpus))})"
    return f"needs {needed} NVIDIA GPU{'s' if needed > 1 else ''}, {seen}" + (f": {why_none}" if why_none else "")


def sglang_cuda_problem() -> str | None:
    """SGLang installed over a CUDA build of torch that sees a device."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (pip install 'ai-dynamo[sglang]' on the GPU machine)"
    try:
        import torch
    except ImportError as exc:
        return f"torch does not import: {exc}"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build; SGLang on GPU needs its pinned CUDA torch"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    return None


@cache
def dynamo_sglang_problem(python: str = sys.executable, timeout: float = 180.0) -> str | None:
    """``dynamo.sglang`` imports (checked once, in a child: the import pulls in SGLang's engine)."""
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.sglang") is None:
        return "dynamo.sglang is not installed (pip install 'ai-dynamo[sglang]')"
    try:
        proc = subprocess.run([python, "-c", "import dynamo.sglang.main"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"importing dynamo.sglang.main took over {timeout:g} s"
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return f"dynamo.sglang does not import: {lines[-1].strip() if lines else f'exit {proc.returncode}'}"
    return None


def resolve_model_dir(model: str) -> tuple[Path | None, str | None]:
    """A local directory for ``model`` (a path or a Hugging Face repo id already in the local
    cache), or why there is none. Never downloads."""
    path = Path(model).expanduser()
    if path.exists():
        return (path, None) if path.is_dir() else (None, "not a directory")
    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        return None, "no such path"
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        return None, "not a local path, and huggingface_hub is not installed to look it up"
    found = try_to_load_from_cache(model, "config.json")
    if not isinstance(found, str):
        return None, f"not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); download it first"
    return Path(found).parent, None


def model_problem(model: str, role: str = "model") -> str | None:
    """``model`` resolves to a directory with ``config.json`` and weights (kvalign's tiny pair is
    written by the run itself)."""
    if model == TINY_MODEL:
        return None
    path, why = resolve_model_dir(model)
    if path is None:
        return f"{role} {model}: {why}"
    if not (path / "config.json").is_file():
        return f"{role} {model}: no config.json in {path}"
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        return f"{role} {model}: no *.safetensors or *.bin weights in {path}"
    return None


@dataclass(frozen=True)
class Prereqs:
    """Result of :func:`check_prereqs`: the visible GPUs and every missing prerequisite."""

    gpus: tuple[Gpu, ...]
    problems: tuple[str, ...]

    @property
    def skip_reason(self) -> str | None:
        return "; ".join(self.problems) if self.problems else None


def check_prereqs(gpus_needed: int, model: str, draft_model: str, *, import_check: bool = True) -> Prereqs:
    """Everything the EAGLE3 disaggregated run needs on this machine.

    ``import_check=False`` skips the slow ``dynamo.sglang`` child import (for ``plan``).
    """
    gpus, why_none = visible_gpus()
    problems = [gpu_problem(gpus_needed, gpus, why_none), sglang_cuda_problem()]
    if import_check:
        problems.append(dynamo_sglang_problem())
    problems += [model_problem(model, "model"), model_problem(draft_model, "draft model")]
    if model == TINY_MODEL and not problems[1]:  # kvalign's tiny pair runs the bundled, stood-in SGLang
        from kvalign.standins.sglang_gpu import version_problem

        problems.append(version_problem())
    return Prereqs(tuple(gpus), tuple(p for p in problems if p))


def environment() -> dict[str, object]:
    """The machine a live run ran on, for its record: Python, torch and CUDA, each visible GPU, and the
    releases of SGLang, its kernel and Dynamo (None where one is not installed)."""
    import platform
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    try:
        import torch

        torch_facts = {"torch": torch.__version__, "cuda": torch.version.cuda}
    except ImportError:
        torch_facts = {"torch": None, "cuda": None}
    gpus, why_none = visible_gpus()
    return {"python": platform.python_version(), **torch_facts,
            "gpus": [{"index": g.index, "name": g.name, "memory_mib": g.memory_mib} for g in gpus],
            **({"no_gpu": why_none} if not gpus else {}),
            **{dist: version(dist) for dist in ("sglang", "sglang-kernel", "ai-dynamo", "ai-dynamo-runtime")}}
