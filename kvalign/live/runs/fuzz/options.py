"""What a fuzz run launches and checks: :class:`FuzzOptions`, validated once, and whether this
machine can run them (:func:`engine_problem`).

Why its own module: every other part of the fuzz reads the options (the plan, the driver, the
command line, the rules), and none of them should have to import the driver to do so; an option
that cannot work together with another is refused here, as one error line, before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvalign.live.cluster.routers import RouterSetup
from kvalign.live.engines.hicache import HiCache
from kvalign.live.runs.fuzz.speculation import DEFAULT_SIZE as SPEC_WINDOW

ENGINES = ("sglang-cpu", "fake-cpu", "sglang-gpu", "vllm-cpu")

TOPOLOGIES = ("agg", "disagg")

#: The first SGLang release with ``KVEventsConfig.format`` ("dynamo"), read in the 0.5.21 and 0.5.23 wheels.
DYNAMO_FORMAT_SINCE = (0, 5, 23)



class FuzzEnvironmentError(RuntimeError):
    """The cluster could not do what a step needs (start, flush, answer): exit 2, not a finding."""



@dataclass(frozen=True)
class FuzzOptions:
    """What a fuzz run launches and how it checks."""

    engine: str = "sglang-cpu"
    topology: Literal["agg", "disagg"] = "agg"
    workers: int = 2  # aggregated workers, or prefill workers in disaggregation (plus one decode)
    page_size: int = 16
    max_total_tokens: int = 512  # small, so a few long prompts make the scheduler evict
    sglang: str | None = None  # an SGLang release from the wheel cache; None: the environment's
    draft: Literal["agree", "disagree"] = "agree"  # disagree: decode speculation's negative control
    router_eagle: bool = True
    gap_check: bool = True  # False: predict the router from the engine's stream (negative control)
    strip_salt: bool = False  # the hop removes cache_salt from stored blocks (negative control)
    hide_gaps: bool = False  # the hop renumbers batches after a loss, hiding the gap from every subscriber
    event_format: str = "default"  # SGLang's KV-event format ("dynamo": --kv-events-config format, SGLang 0.5.23+)
    publisher_faults: bool = False  # the workers load kvalign's publisher-fault hook (a test control; scripts arm it)
    quiet_s: float = 0.4
    settle_timeout_s: float = 8.0
    restart_grace_s: float = 2.0
    fill_prompts: int = 4
    startup_timeout_s: float = 600.0
    routers: int = 1  # dynamo.frontend replicas (kvalign.live.runs.fuzz.replicas)
    replica_sync: bool = True  # False: router1 runs without --router-replica-sync (routers_agree's control)
    router_mode: Literal["events", "approx"] = "events"  # approx: --no-router-kv-events, measured not judged
    approx_policy: Literal["ttl", "lru"] = "ttl"
    router_ttl: float | None = None
    hicache: HiCache | None = None  # SGLang's host tier on the publishing workers (the HiCache rules run)
    dp_size: int = 1  # SGLang's --dp-size of each aggregated worker: one source per rank (.dp_ranks)
    rank0_only: bool = False  # negative control: every rank but 0 is silent at its hop (only rank 0 publishes)
    dp_attention: bool = False  # the ranks are attention-DP groups of one TP group, not replicas
    spec_window: int = SPEC_WINDOW  # requests per decode_keeps_speculating judgment on one decode worker (.speculation)
    transfer: str | None = None  # disagg: SGLang's prefill->decode backend (None: the release's; fake: kv_transferred's control)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"--topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        if self.workers < 1 or self.workers * self.dp_size < 2:
            raise ValueError(f"the fuzz needs at least 2 workers or data-parallel ranks (routing has a choice), got "
                             f"{self.workers} worker(s) x {self.dp_size} rank(s)")
        if self.dp_size > 1 and (self.topology == "disagg" or self.hicache is not None or self.routers > 1
                                 or self.publisher_faults):
            raise ValueError("--dp-size runs aggregated workers behind one router, without --hicache or publisher faults")
        if self.dp_attention and self.dp_size < 2:
            raise ValueError("--dp-attention needs --dp-size 2 or more")
        if self.rank0_only and self.dp_size < 2:
            raise ValueError("--only-rank0-publishes needs --dp-size 2 or more")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.transfer is not None and (self.topology != "disagg" or self.transfer not in ("nixl", "fake")):
            raise ValueError(f"--transfer nixl|fake picks the prefill->decode backend of --topology disagg, got "
                             f"{self.transfer!r} on {self.topology}")
        if self.spec_window < 1:
            raise ValueError(f"--spec-window must be >= 1, got {self.spec_window}")
        if self.draft not in ("agree", "disagree"):
            raise ValueError(f"--draft must be agree or disagree, got {self.draft!r}")
        if self.event_format not in ("default", "dynamo"):
            raise ValueError(f"--event-format must be default or dynamo, got {self.event_format!r}")
        if not self.replica_sync and self.routers < 2:
            raise ValueError("--no-replica-sync needs --routers 2 or more (it starts the second router without sync)")
        if self.routers > 1 and self.router_mode == "approx":
            raise ValueError("--routers 2+ with --router-mode approx: an approximate router's prediction has no live "
                             "reference to hold replicas to here; run `kvalign live up --routers 2 --router-mode approx "
                             "--scenario`, which holds them to the routing decisions")
        self.router_setup()

    def router_setup(self) -> RouterSetup:
        """The frontends this run starts (:mod:`kvalign.live.cluster.routers`)."""
        return RouterSetup(self.routers, self.router_mode, frozenset() if self.replica_sync else frozenset({1}),
                           self.approx_policy, self.router_ttl)

    def as_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "topology": self.topology, "workers": self.workers,
                "page_size": self.page_size, "max_total_tokens": self.max_total_tokens, "sglang": self.sglang,
                "draft": self.draft, "router_eagle": self.router_eagle, "gap_check": self.gap_check,
                "strip_salt": self.strip_salt, "hide_gaps": self.hide_gaps, "routers": self.routers,
                "replica_sync": self.replica_sync, "router_mode": self.router_mode, "approx_policy": self.approx_policy,
                "router_ttl": self.router_ttl, **({"publisher_faults": True} if self.publisher_faults else {}),
                "hicache": None if self.hicache is None else {"write_policy": self.hicache.write_policy,
                                                              "ratio": self.hicache.ratio,
                                                              **({"storage": self.hicache.storage}
                                                                 if self.hicache.storage else {})},
                "event_format": self.event_format, "spec_window": self.spec_window,
                **({"transfer": self.transfer} if self.transfer else {}),
                **({"dp_size": self.dp_size} if self.dp_size > 1 else {}),
                **({"dp_attention": True} if self.dp_attention else {}),
                **({"rank0_only": True} if self.rank0_only else {})}



def engine_problem(opts: FuzzOptions) -> str | None:
    """Why ``opts.engine`` cannot run the fuzz on this machine (None when it can)."""
    if opts.hicache is not None and opts.hicache.storage is not None and (opts.engine != "sglang-cpu"
                                                                         or opts.topology != "agg"):
        return ("--storage runs on --engine sglang-cpu with aggregated workers (the storage refill is judged on the "
                "worker's own reuse report)")
    if opts.engine == "sglang-gpu":
        if opts.sglang is not None or opts.dp_size > 1 or opts.publisher_faults or opts.event_format != "default":
            return ("--engine sglang-gpu runs the bundled SGLang with one rank per worker and SGLang's own publisher: "
                    "--sglang, --dp-size, publisher faults and --event-format dynamo run on --engine sglang-cpu")
        from kvalign.live.engines.sglang_gpu import engine_problem as gpu_problem

        return gpu_problem()
    if opts.engine == "vllm-cpu":
        from kvalign.live.engines.vllm_cpu import fuzz_problem

        return fuzz_problem(opts)
    if opts.engine == "fake-cpu":
        return ("--engine fake-cpu has no engine reuse report (cached_tokens) and no "
                "speculative decoder; the fuzz needs the real engine: run --engine sglang-cpu")
    from kvalign.live.engines.sglang_cpu import engine_problem as cpu_problem

    problem = cpu_problem(opts.sglang)
    if problem is None and opts.event_format == "dynamo":
        from kvalign.verify.report.matrix import installed

        version = opts.sglang or installed("sglang") or ""
        if tuple(int(x) for x in version.split(".")[:3] if x.isdigit()) < DYNAMO_FORMAT_SINCE:
            return (f"SGLang {version} has no \"dynamo\" KV-event format (--kv-events-config format arrived in "
                    f"{'.'.join(map(str, DYNAMO_FORMAT_SINCE))})")
    return problem

