"""SGLang's data-parallel schedulers as its launcher places them, each with its real KV-event publisher.

Under data parallelism each KV cache is one scheduler, and each must publish on a port of its own
so that a consumer can subscribe per rank: SGLang 0.5.23 offsets the configured endpoint's port by
``select_kv_publisher_dp_rank`` (``attn_dp_rank`` under DP attention, ``dp_rank`` under pure DP) and
``ZmqEventPublisher`` stamps that rank on every batch as ``attn_dp_rank``. Before that function,
only rank 0 published (sgl-project/sglang #16030, #16412). So nothing here picks a rank or a port:

* the worker's ``ServerArgs`` come from SGLang's own parser and resolution (``--dp-size N``, or
  ``--tp-size N --attn-dp-size N``), for a config-only copy of the live layer's tiny Llama;
* the schedulers are enumerated as ``DataParallelController`` launches them (pure DP: one TP group
  per ``dp_rank``; DP attention: one TP group whose ``dp_rank`` comes from
  ``compute_dp_attention_world_info``), each given the ``SpawnRanks`` its process publishes;
* each scheduler's ``SchedulerKvEventsPublisher`` is SGLang's own, built in that scheduler's
  ``RuntimeContext``: it decides whether the scheduler publishes (``is_kv_publisher_rank``), which
  rank and port (``select_kv_publisher_dp_rank``), and stamps the batches it publishes from the
  scheduler's real radix cache (``publish_kv_events``).

The two negative controls are the engine-side faults the issue history names, applied to the real
objects: ``rank0-only`` gives every scheduler but publisher rank 0 no ``--kv-events-config`` (SGLang's
own "not a publisher" path, what #16030 reported), ``tag-rank0`` publishes each batch stamped
``attn_dp_rank=0`` (what kvalign's own harness did before, and every pure-DP scheduler before
``select_kv_publisher_dp_rank``).
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.config_model import config_model_dir
from kvalign.oracles.sglang import SglangRadixCache, _modules, shutdown_publisher, sglang_version

LOOPBACK = "127.0.0.1"
#: Sentinel pages use token ids from here up, one id per sentinel (generated prompts use small ids).
SENTINEL_BASE = 0xF000_0000
SGLANG_FAULTS = ("rank0-only", "tag-rank0")


@dataclass(frozen=True)
class DpLayout:
    """One data-parallel deployment of a worker: the SGLang flags that give it, and its KV caches."""

    name: str
    argv: tuple[str, ...]
    ranks: int
    attention: bool

    def describe(self) -> str:
        return f"{'DP attention' if self.attention else 'pure DP'}, {self.ranks} ranks ({' '.join(self.argv)})"


#: The layouts ``check --property dp`` runs, by row variant: pure DP and DP attention at 2 and 4 ranks.
DP_LAYOUTS: dict[str, DpLayout] = {layout.name: layout for layout in (
    DpLayout("pure-dp2", ("--dp-size", "2"), 2, False),
    DpLayout("pure-dp4", ("--dp-size", "4"), 4, False),
    DpLayout("dp-attn2", ("--tp-size", "2", "--attn-dp-size", "2"), 2, True),
    DpLayout("dp-attn4", ("--tp-size", "4", "--attn-dp-size", "4"), 4, True),
)}

#: The live layer's tiny Llama (kvalign/live/engines/engine_model.py), config only: SGLang's argument
#: resolution reads the model's config, and nothing here loads weights.
_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-06, "torch_dtype": "float32",
    "bos_token_id": 2, "eos_token_id": 3, "tie_word_embeddings": False, "rope_theta": 10000.0, "hidden_act": "silu",
}


@cache
def _model_dir() -> str:
    return config_model_dir("llama", _CONFIG)


def free_port_range(n: int, lo: int = 20000, hi: int = 32767) -> int:
    """The first port of ``n`` consecutive ports free on loopback right now (SGLang binds base + rank)."""
    import random

    rng = random.Random()
    for _ in range(200):
        base = rng.randint(lo, hi - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((LOOPBACK, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OracleUnavailable(f"no {n} consecutive free ports on {LOOPBACK}")


@cache
def _sglang() -> Any:
    """SGLang's pieces for DP placement, or :class:`OracleUnavailable` naming what this release lacks."""
    _modules()
    import types

    try:
        from sglang.srt import runtime_context as rc
        from sglang.srt.disaggregation import kv_events
        from sglang.srt.layers.dp_attention import compute_dp_attention_world_info
        from sglang.srt.managers.scheduler_components.kv_events_publisher import SchedulerKvEventsPublisher
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        raise OracleUnavailable(f"sglang {sglang_version()} has no per-scheduler KV-event publisher to place by DP "
                                f"rank ({exc})") from None
    for name in ("create_context", "use_context", "SpawnRanks", "spawn_world_rank"):
        if not hasattr(rc, name):
            raise OracleUnavailable(f"sglang {sglang_version()}'s runtime_context has no {name}")
    if not hasattr(kv_events, "select_kv_publisher_dp_rank"):
        raise OracleUnavailable(f"sglang {sglang_version()} has no select_kv_publisher_dp_rank")
    return types.SimpleNamespace(rc=rc, kv=kv_events, world_info=compute_dp_attention_world_info,
                                 SchedulerKvEventsPublisher=SchedulerKvEventsPublisher, ServerArgs=ServerArgs)


def sentinel_page(k: int, page_size: int) -> Any:
    """The k-th one-page plain ``BlockStored`` off the root (SGLang's own class): a barrier on one rank's
    stream, published after that rank's pending events. Its token ids start at :data:`SENTINEL_BASE`."""
    return _sglang().kv.BlockStored(block_hashes=[(1 << 62) + k], parent_block_hash=None,
                                    token_ids=sentinel_tokens(k, page_size), block_size=page_size, lora_id=None,
                                    medium="GPU")


def sentinel_tokens(k: int, page_size: int) -> list[int]:
    return [SENTINEL_BASE + k] * page_size


def kv_events_config(base_port: int) -> str:
    """The ``--kv-events-config`` of a DP worker: bound on loopback, ranks at ``base_port + rank``."""
    return json.dumps({"publisher": "zmq", "topic": "", "endpoint": f"tcp://{LOOPBACK}:{base_port}", "bind": True})


def server_args(layout: DpLayout, *, page_size: int, config: str) -> Any:
    """The worker's resolved ``ServerArgs``, from SGLang's own parser: what ``sgl.Engine`` gets."""
    m = _sglang()
    parser = argparse.ArgumentParser()
    m.ServerArgs.add_cli_args(parser)
    argv = ["--model-path", _model_dir(), "--device", "cpu", "--page-size", str(page_size),
            "--kv-events-config", config, *layout.argv]
    args = m.ServerArgs.from_cli_args(parser.parse_args(argv))
    args.resolve_once()
    return args


@dataclass
class Scheduler:
    """One scheduler process of the worker, as launched: its ranks, its context, its publisher, its cache."""

    tp_rank: int
    dp_rank: int | None  # what the launcher hands it (``SpawnRanks.dp_rank``)
    context: Any
    events: Any  # SGLang's SchedulerKvEventsPublisher
    cache: SglangRadixCache
    fault: str | None = None

    @property
    def parallel(self) -> Any:
        return self.context.parallel

    @property
    def publishes(self) -> bool:
        return bool(self.events.enable_kv_cache_events)

    @property
    def publisher_rank(self) -> int | None:
        """The rank its publisher offsets its port by and stamps on its batches (None: not a publisher)."""
        pub = self.events.kv_event_publisher
        return None if pub is None else int(pub._dp_rank)

    @property
    def source(self) -> dict[str, Any] | None:
        """What the publisher advertises for itself (its bound endpoint and rank), SGLang's own description."""
        sources = self.events.local_kv_event_sources(self.cache.page_size)
        return sources[0] if sources else None

    def store(self, tokens: Sequence[int]) -> None:
        """Cache a finished request's tokens and publish, as the scheduler does after a forward."""
        self.cache.insert(tokens)
        self.publish()

    def publish(self, events: Sequence[Any] = ()) -> None:
        """Publish the cache's pending events (plus ``events``, e.g. a sentinel page) on this scheduler's stream."""
        if not self.publishes:
            self.cache.take_raw_events()
            return
        if not events and self.fault != "tag-rank0":
            self.events.publish_kv_events()  # SGLang's own: take_events -> KVEventBatch -> publish
            return
        batch = _sglang().kv.KVEventBatch(ts=time.time(), events=[*self.cache.take_raw_events(), *events])
        if self.fault == "tag-rank0":
            batch.attn_dp_rank = 0
        self.events.kv_event_publisher.publish(batch)

    def close(self) -> None:
        if self.events.kv_event_publisher is not None:
            shutdown_publisher(self.events.kv_event_publisher)


@dataclass
class DpEngine:
    """A worker's schedulers, one KV cache per publisher rank."""

    layout: DpLayout
    server_args: Any
    base_port: int
    schedulers: list[Scheduler] = field(default_factory=list)

    def by_rank(self) -> dict[int, Scheduler]:
        """The KV cache of every DP rank (the scheduler whose attention group that rank is), by rank.

        The rank is the one SGLang's launch gives each scheduler's cache (``dp_rank`` under pure DP,
        ``attn_dp_rank`` under DP attention), whether or not its scheduler publishes."""
        out: dict[int, Scheduler] = {}
        for s in self.schedulers:
            p = s.parallel
            if p.attn_tp_rank != 0 or p.pp_rank != 0:
                continue  # the other members of an attention-TP group share its leader's cache
            out[int(p.attn_dp_rank if p.attn_dp_enabled else (p.dp_rank or 0))] = s
        return out

    def close(self) -> None:
        for s in self.schedulers:
            s.close()


def placements(server_args: Any) -> list[tuple[int, int | None]]:
    """``(tp_rank, dp_rank)`` of every scheduler, in the order ``DataParallelController`` launches them."""
    m = _sglang()
    probe = m.rc.create_context(server_args, role="scheduler", ranks=m.rc.SpawnRanks(world_rank=0, dp_rank=0))
    p = probe.parallel
    if p.attn_dp_enabled:
        return [(tp, int(m.world_info(tp, p.tp_size, p.attn_dp_size, p.attn_cp_size)[2])) for tp in range(p.tp_size)]
    if p.num_dp_ranks > 1:
        return [(tp, dp) for dp in range(p.num_dp_ranks) for tp in range(p.tp_size)]
    return [(tp, None) for tp in range(p.tp_size)]


def launch(layout: DpLayout, *, page_size: int, eagle: bool = False, fault: str | None = None) -> DpEngine:
    """Every scheduler of ``layout``, with its own real publisher bound on loopback and its own cache."""
    if fault is not None and fault not in SGLANG_FAULTS:
        raise ValueError(f"unknown SGLang DP fault {fault!r}; expected one of {SGLANG_FAULTS}")
    m = _sglang()
    base = free_port_range(layout.ranks)
    config = kv_events_config(base)
    args = server_args(layout, page_size=page_size, config=config)
    engine = DpEngine(layout, args, base)
    try:
        for tp_rank, dp_rank in placements(args):
            ranks = m.rc.SpawnRanks(world_rank=m.rc.spawn_world_rank(args, tp_rank=tp_rank, pp_rank=0), dp_rank=dp_rank)
            context = m.rc.create_context(args, role="scheduler", ranks=ranks)
            p = context.parallel
            rank = m.kv.select_kv_publisher_dp_rank(p.attn_dp_size, p.attn_dp_rank, p.dp_rank)
            own = config if fault != "rank0-only" or rank == 0 else None
            cache = SglangRadixCache(page_size, eagle=eagle)
            with m.rc.use_context(context):
                events = m.SchedulerKvEventsPublisher(
                    kv_events_config=own, tree_cache=cache._cache, send_metrics_from_scheduler=None,
                    max_running_requests=1, max_total_num_tokens=1, get_stats=None)
            engine.schedulers.append(Scheduler(tp_rank, dp_rank, context, events, cache, fault))
    except BaseException:
        engine.close()
        raise
    return engine
