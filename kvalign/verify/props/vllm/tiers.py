"""The ``tiers`` row of ``check --engine vllm``: vLLM's device cache and its CPU offload tier behind the real relay.

vLLM's ``KVCacheManager`` publishes its blocks with ``medium`` ``GPU``; the offload connector publishes the
chunks it stored in its CPU tier with ``medium`` ``CPU`` (:mod:`kvalign.oracles.vllm_offload`: vLLM's real
``CPUOffloadingManager`` and ``OffloadingEventsTracker``). The relay files each medium under a router tier
(:data:`MEDIA`, measured on 1.6.1). Before each prompt of a generated sequence (a small device cache, so blocks
leave it while the CPU tier keeps them), the row checks the router's ``device_blocks`` against vLLM's own device
prefix hit, and ``device + host_pinned_extension_blocks`` against what vLLM holds after the connector's load
(both in blocks, capped one token short of the prompt as vLLM computes its last token). With one block per
chunk the connector can load every block it advertises; with more (vllm#57159), see
:func:`chunk_granularity`'s finding. A negative control relabels the connector's ``CPU`` events as ``GPU`` on
the hop (a relay that files the host tier as device): the row fails ``TIER_MISFILED``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from kvalign.model.causes import Cause
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.props.vllm.strategies import Served, fresh_base

#: vLLM's media (``vllm.distributed.kv_events.MEDIUM_*``) -> the router tier Dynamo 1.6.1's relay files them
#: under (measured through the relay: ``tests/unit/oracles/test_vllm_tiers.py``)
MEDIA = {"GPU": "device", "CPU": "host_pinned", "STORAGE": "disk"}
#: the row's CPU tier: chunks of one block (every advertised block loadable), more chunks than device blocks
OFFLOAD = {"blocks_per_chunk": 1, "num_chunks": 24}


@dataclass(frozen=True)
class Credit:
    """One query's answers, in blocks: the router's device and host-extension credit, vLLM's device hit and
    what it holds after the connector's load."""

    device: int
    host: int
    vllm_device: int
    vllm_loaded: int


def credit(worker: Any, tokens: list[int]) -> Credit:
    """The router's and vLLM's answers for ``tokens`` (the router's capped one token short of the prompt)."""
    b, cap = worker.engine.block_size, (len(tokens) - 1) // worker.engine.block_size
    t = worker.tiers(tokens)
    device = min(t["device_blocks"], cap)
    return Credit(device, min(t["device_blocks"] + t["host_pinned_extension_blocks"], cap) - device,
                  worker.engine.match(tokens, device_only=True) // b, worker.engine.match(tokens) // b)


def judge(c: Credit) -> tuple[Cause, str] | None:
    """None when the router credits each tier what vLLM serves from it; else the cause and what differs."""
    if c.device != c.vllm_device:
        return Cause.TIER_MISFILED, (f"the router credits {c.device} device blocks, vLLM's device cache holds "
                                     f"{c.vllm_device}")
    if c.device + c.host > c.vllm_loaded:
        return (Cause.HOST_CREDIT_NOT_SERVABLE if c.host else Cause.INGEST_STALE,
                f"the router credits {c.device} device + {c.host} host blocks, vLLM holds {c.vllm_loaded} after the "
                "offload connector's load")
    if c.device + c.host < c.vllm_loaded:
        return Cause.EVENTS_DROPPED, (f"the router credits {c.device} device + {c.host} host blocks, vLLM holds "
                                      f"{c.vllm_loaded} after the offload connector's load")
    return None


def tiers_body(worker: Any) -> Any:
    """Before each prompt, the router's per-tier credit = what vLLM's device cache and CPU tier serve."""

    def body(seq: list[Served]) -> None:
        base, b = fresh_base(), worker.engine.block_size
        for i, served in enumerate(seq):
            tokens = served.tokens(base, b)
            found = judge(credit(worker, tokens))
            if found:
                raise Mismatch("tiers", f"prompt {i}: {found[1]}", found[0], seq)
            worker.engine.prefill(tokens)
            worker.sync()

    return body


def tier_sequences(b: int) -> st.SearchStrategy[list[Served]]:
    """1-8 prompts of 1-5 blocks from a pool of 3 and a 1..B-1 tail (the connector loads whole chunks of a
    prompt whose last token it must compute: the tail keeps the last chunk complete and short of it)."""
    one = st.builds(Served, st.lists(st.integers(0, 2), min_size=1, max_size=5).map(tuple), st.integers(1, b - 1))
    return st.lists(one, min_size=1, max_size=8)


def cpu_as_gpu(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A relay that files the CPU tier's events as device blocks."""
    for e in events:
        if e.get("medium") == "CPU":
            e["medium"] = "GPU"
    return events


#: the control's sequence: a prompt, three that evict it from the device cache (the CPU tier keeps it), it again
CONTROL_SEQUENCE = [Served((0, 1, 2), 3), Served((0, 0, 0, 0, 0), 1), Served((1, 1, 1, 1, 1), 1),
                    Served((2, 2, 2, 2), 1), Served((0, 1, 2), 3)]


def row(path: Any, b: int, n: int, seed: int | None) -> RowResult:
    """The ``tiers`` row on a vLLM engine of its own (a CPU tier behind a small device cache), with its control."""
    from kvalign.verify.props.vllm.running import NUM_BLOCKS, control_run, on_engine, search_row

    def rows(worker: Any) -> list[RowResult]:
        return [search_row("tiers", tiers_body(worker), tier_sequences(b), n, seed,
                           ("cpu_as_gpu (the relay files the CPU tier's blocks as device blocks)",
                            control_run(worker, tiers_body(worker), CONTROL_SEQUENCE, seed, cpu_as_gpu),
                            Cause.TIER_MISFILED))]

    return on_engine([("tiers", "base")], path, b, NUM_BLOCKS, rows, offload=OFFLOAD)[0]
