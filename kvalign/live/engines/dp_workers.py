"""What a data-parallel real-engine CPU worker needs beyond the others (``--dp-size N``).

SGLang's ``DataParallelController`` starts one scheduler per rank, each its own TP group with its
own KV cache, and each publishes its KV events on ``port + rank`` (``select_kv_publisher_dp_rank``);
``dynamo.sglang`` registers ranks ``[0, N)`` and subscribes its relay to each rank's port. On this
CPU two settings differ from a one-rank worker, both seen live on SGLang 0.5.23:

* no ``--nccl-port``: every DP rank's ``torch.distributed`` group takes ``PortArgs.init_new``'s port,
  which is ``--nccl-port`` when given, so the second rank's TCP store failed with EADDRINUSE. Without
  it 0.5.23 picks a free port per rank below the ephemeral range (the race ``--nccl-port`` avoids
  was seen before 0.5.23, which is why only 0.5.23 runs DP here);
* ``SGLANG_CPU_OMP_THREADS_BIND``: SGLang's CPU path refuses more ranks than NUMA nodes unless each
  rank's cores are named; each rank gets its own share of this machine's cores (ranks share cores
  round-robin when there are more ranks than cores).

DP attention (``--tp-size N --attn-dp-size N``) is not run live on this CPU: see
:data:`DP_ATTENTION_PROBLEM`.
"""

from __future__ import annotations

import os

#: Why DP attention is not started on the CPU engine (the ``check`` rows run it on both sides' code).
DP_ATTENTION_PROBLEM = ("DP attention needs --tp-size N with N > 1 on the CPU engine, and SGLang's CPU tensor "
                        "parallelism all-reduces through sgl_kernel's shared-memory CPU ops, which the CPU "
                        "build of sgl-kernel provides and kvalign's stand-in does not")

#: The SGLang releases whose data-parallel workers run here (KV-event ``bind`` and per-rank nccl ports).
DP_RELEASES = ("0.5.23",)


def dp_args(dp_size: int, attention: bool = False) -> list[str]:
    """SGLang's flags for ``dp_size`` ranks: replicas (``--dp-size``), or attention-DP groups of one TP
    group (``--tp-size N --attn-dp-size N``, SGLang 0.5.23's spelling of ``--enable-dp-attention``)."""
    if dp_size == 1:
        return []
    return ["--tp-size", str(dp_size), "--attn-dp-size", str(dp_size)] if attention else ["--dp-size", str(dp_size)]


def threads_bind(dp_size: int, cpus: list[int] | None = None) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND``: rank r's cores, ``|``-separated, an even share each."""
    cores = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if dp_size >= len(cores):
        return "|".join(str(cores[r % len(cores)]) for r in range(dp_size))
    share = len(cores) // dp_size
    spans = [cores[r * share:(r + 1) * share] for r in range(dp_size)]
    return "|".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0]) for s in spans)


def dp_problem(sglang_version: str, dp_size: int) -> str | None:
    """Why ``dp_size`` ranks cannot run on this release here (None when they can)."""
    if dp_size > 1 and sglang_version not in DP_RELEASES:
        return (f"--dp-size runs on SGLang {', '.join(DP_RELEASES)} here, not {sglang_version}: before 0.5.23 the "
                "KV-event publisher cannot bind its per-rank ports itself and a fixed --nccl-port collides across ranks")
    return None
