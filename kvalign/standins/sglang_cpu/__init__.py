"""Stand-ins for the parts of SGLang that do not run on a CPU-only machine, for real-engine workers.

SGLang (0.5.23; likewise each release in :data:`SUPPORTED`) runs its real server on CPU (``SGLANG_USE_CPU_ENGINE=1``) only with the CPU build
of ``sgl-kernel``, which is not on the package index (its wheels are CUDA builds), and its EAGLE
and prefill/decode code paths need two narrow patches on the ``torch_native`` backend. This
package is everything kvalign adds to a real SGLang process, in one place:

* :mod:`.kernels` — pure-torch versions of the ``sgl_kernel`` ``*_cpu`` functions SGLang imports,
  each tested against SGLang's own Triton kernel (``tests/unit/standins/test_sglang_cpu_standin_kernels.py``);
* :mod:`.ops` — ``torch.ops.sgl_kernel.*`` names SGLang looks up at import time on paths a Llama
  never executes, registered as ops that raise when called;
* :mod:`.patches` — the EAGLE-on-torch_native and fake-transfer patches;
* ``site/`` — the directory put first on ``PYTHONPATH`` of the worker processes *only*: an
  ``sgl_kernel`` package exporting exactly the stand-in names (anything else raises ImportError,
  which SGLang's ``try/except ImportError`` fallbacks rely on) and a ``sitecustomize`` that
  installs the patches in every process SGLang spawns.

It is pinned per release: :data:`SUPPORTED` lists the SGLang releases it was written and tested
for (the environment's :data:`SGLANG_VERSION` and the releases Dynamo ships or a nightly ran), and a
worker with any other SGLang stops at start-up with :func:`version_problem`'s message. kvalign's
oracles never import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

#: The environment's SGLang (scripts/setup.sh); other supported releases run from matrix's wheel cache.
SGLANG_VERSION = "0.5.23"


@dataclass(frozen=True)
class Release:
    """What differs between the supported releases on the workers' path.

    ``kv_events_bind``: the KV-events config has ``bind`` (0.5.23+). Before, the config model drops
    the key and the publisher *connects* to a concrete host, as Dynamo's relay does: the harness then
    points the publisher at a local IPC socket (the ``kv_events_local_publish`` patch) and runs a
    loopback forwarder that binds the relay's 127.0.0.1 endpoint (:mod:`kvalign.live.wire.kv_forwarder`).
    ``patches``: module -> names of the extra :mod:`.patches` functions this release needs on top of
    the common ones (run right after that module executes).
    """

    kv_events_bind: bool
    patches: tuple[tuple[str, str], ...] = ()
    #: the prefill->decode transfer backend its workers run by default: ``nixl`` where
    #: :mod:`.kv_transfer` was written and tested (SGLang's NIXL path on host memory, its KV checksum),
    #: ``fake`` elsewhere (no KV byte moves)
    transfer: str = "fake"


#: Before 0.5.23: the publisher binds the harness's IPC socket (no ``bind``), and the paged
#: allocator launches Triton kernels with no CPU path.
_BEFORE_0_5_23 = (("sglang.srt.disaggregation.kv_events", "kv_events_local_publish"),
                  ("sglang.srt.mem_cache.allocator.paged", "paged_allocator_on_cpu"))

SUPPORTED: dict[str, Release] = {
    "0.5.19": Release(kv_events_bind=False, patches=_BEFORE_0_5_23),  # the gpu_2 nightly's release
    "0.5.21": Release(kv_events_bind=False, patches=_BEFORE_0_5_23),  # the one ai-dynamo[sglang]==1.6.1 pins
    "0.5.23": Release(kv_events_bind=True, transfer="nixl"),
}

#: Put first on PYTHONPATH of real-engine worker processes (and nowhere else).
SITE_DIR = Path(__file__).resolve().parent / "site"

#: Set to "1" in a worker's environment to load the stand-in there.
ENABLE_ENV = "KVALIGN_SGLANG_STANDIN"


def version_problem(version: str | None = None) -> str | None:
    """Why the stand-in cannot serve ``version`` (default: the importable SGLang); None when it can."""
    if version is None:
        try:
            version = metadata.version("sglang")
        except metadata.PackageNotFoundError:
            return "sglang is not installed (scripts/setup.sh installs it)"
    if version not in SUPPORTED:
        return (f"kvalign's SGLang CPU stand-in supports sglang {', '.join(SUPPORTED)}, not sglang {version}: "
                "the real-engine CPU workers need one of those")
    return None


def worker_env(pythonpath: str | None = None) -> dict[str, str]:
    """Environment that loads the stand-in into a worker process (and its SGLang children).

    ``pythonpath`` follows the stand-in's site dir: a release from the wheel cache goes first in it."""
    path = str(SITE_DIR) if not pythonpath else f"{SITE_DIR}:{pythonpath}"
    return {ENABLE_ENV: "1", "PYTHONPATH": path, "SGLANG_USE_CPU_ENGINE": "1"}


#: Set by the harness (releases without ``bind`` only): the IPC endpoint SGLang's KV-event PUB binds
#: instead of connecting to the relay's address; the loopback forwarder carries it to that address.
KV_EVENTS_IPC_ENV = "KVALIGN_KV_EVENTS_IPC"

#: A test control, set only by the live fuzz's ``publisher_faults`` option: the control file through
#: which :mod:`.publisher_faults` is armed in one worker (unset on the normal path: the hook is not loaded).
PUBLISHER_FAULTS_ENV = "KVALIGN_PUBLISHER_FAULTS"
