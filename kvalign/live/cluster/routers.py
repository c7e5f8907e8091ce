"""The routers of a live cluster: how many ``dynamo.frontend`` replicas, and how each tracks the cache.

Production runs several frontends, each with its own KV router. Dynamo 1.6.1 documents two state
families per router (``docs/components/router/router-operations.md``):

* **prefix-cache state** (what each worker holds): in *events* mode every replica consumes the
  workers' KV events from the event plane, so replicas agree without talking to each other; in
  *approximate* mode (``--no-router-kv-events``) each replica predicts it from its own routing
  decisions, expiring them by ``--router-approximate-cache-policy`` (``ttl`` after
  ``--router-ttl-secs``, or ``lru`` by each worker's advertised capacity);
* **active-sequence state** (which requests are in flight where, for load balancing): local to
  the router that routed them, unless ``--router-replica-sync`` makes replicas publish and
  subscribe to each other's request lifecycle events on the event plane.

:class:`RouterSetup` says which of these a run uses;
:func:`kvalign.live.cluster.lifecycle.with_routers` gives a planned cluster its extra frontends (ports on loopback, like every other listener). Replica sync is on for every
replica of a multi-router run, as Dynamo's docs launch them, except the replicas named in
``unsynced`` (the negative control: a replica started without the flag).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

RouterMode = Literal["events", "approx"]
ROUTER_MODES: tuple[RouterMode, ...] = ("events", "approx")
ApproxPolicy = Literal["ttl", "lru"]
APPROX_POLICIES: tuple[ApproxPolicy, ...] = ("ttl", "lru")


@dataclass(frozen=True)
class RouterSetup:
    """How many frontend replicas a cluster runs and how their KV routers track the cache."""

    count: int = 1
    mode: RouterMode = "events"
    unsynced: frozenset[int] = field(default_factory=frozenset)  # replicas started without replica sync
    approx_policy: ApproxPolicy = "ttl"
    ttl_secs: float | None = None  # --router-ttl-secs (approx mode); None: Dynamo's default (120 s)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"--routers must be >= 1, got {self.count}")
        if self.mode not in ROUTER_MODES:
            raise ValueError(f"--router-mode must be one of {', '.join(ROUTER_MODES)}, got {self.mode!r}")
        if self.approx_policy not in APPROX_POLICIES:
            raise ValueError(f"--approx-policy must be one of {', '.join(APPROX_POLICIES)}, got {self.approx_policy!r}")
        if self.ttl_secs is not None and not self.ttl_secs > 0:
            raise ValueError(f"--router-ttl must be > 0 seconds, got {self.ttl_secs}")
        bad = sorted(i for i in self.unsynced if not 0 <= i < self.count)
        if bad:
            raise ValueError(f"unsynced replicas {bad} are not among the {self.count} routers")

    @property
    def replicated(self) -> bool:
        return self.count > 1

    def synced(self, replica: int) -> bool:
        """Whether ``replica`` runs with ``--router-replica-sync`` (every replica of a multi-router run
        but the ones in ``unsynced``; a lone router has no peer to sync with)."""
        return self.replicated and replica not in self.unsynced

    def flags(self, replica: int) -> list[str]:
        """The ``dynamo.frontend`` flags of ``replica`` beyond the single-router command."""
        out: list[str] = []
        if self.mode == "approx":
            out += ["--no-router-kv-events", "--router-approximate-cache-policy", self.approx_policy]
            if self.ttl_secs is not None:
                out += ["--router-ttl-secs", f"{self.ttl_secs:g}"]
        if self.synced(replica):
            out.append("--router-replica-sync")
        return out

    def describe(self) -> str:
        """One phrase for progress lines: ``2 routers (events, replica sync; router1 unsynced)``."""
        mode = self.mode if self.mode == "events" else f"approx, {self.approx_policy}" + (
            f" {self.ttl_secs:g}s" if self.ttl_secs is not None and self.approx_policy == "ttl" else "")
        if not self.replicated:
            return f"1 router ({mode})"
        unsynced = "".join(f"; {router_name(i)} unsynced" for i in sorted(self.unsynced))
        return f"{self.count} routers ({mode}, replica sync{unsynced})"


def router_name(replica: int) -> str:
    """``router0`` is the cluster's first frontend (its process is logged as ``frontend``)."""
    return f"router{replica}"


def frontend_process_name(replica: int) -> str:
    """The process (and log file) name of replica ``replica``: ``frontend``, ``frontend1``, ..."""
    return "frontend" if replica == 0 else f"frontend{replica}"
