"""HiCache (SGLang's host KV tier) on the live layer's real CPU workers: the settings and their flags.

``--hicache [POLICY]`` on ``kvalign live up``, ``kvalign e2e run`` and ``kvalign e2e fuzz`` starts
every worker that caches prompts (aggregated and prefill workers; a decode worker never keeps a
prefix) with ``--enable-hierarchical-cache --hicache-write-policy POLICY --hicache-ratio R``. The
host tier then runs SGLang's own controller and host pool inside the worker, with the two CUDA-only
pieces stood in (:mod:`kvalign.standins.hicache_cpu`). The IO backend and host layout stay SGLang's
defaults (``kernel``, ``page_first``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvalign.standins import hicache_cpu

#: ``--hicache`` with no policy: SGLang's own default write policy.
DEFAULT_POLICY = "write_through"
WRITE_POLICIES = hicache_cpu.WRITE_POLICIES


@dataclass(frozen=True)
class HiCache:
    """One run's host tier: SGLang's write policy and the host pool's size relative to the device pool."""

    write_policy: str = DEFAULT_POLICY
    #: ``--hicache-ratio``: host pool = ratio x device pool (SGLang's default is 2.0 too; named here so
    #: the host tier's size, and so when it evicts, does not move with SGLang's auto-sizing)
    ratio: float = 2.0

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache takes a write policy of {', '.join(WRITE_POLICIES)}, got {self.write_policy!r}")
        if not self.ratio > 0:
            raise ValueError(f"--hicache-ratio must be > 0, got {self.ratio}")

    def args(self) -> list[str]:
        """The SGLang server flags of a worker that caches prompts."""
        return ["--enable-hierarchical-cache", "--hicache-write-policy", self.write_policy,
                "--hicache-ratio", f"{self.ratio:g}"]

    def describe(self) -> str:
        return f"HiCache {self.write_policy} (host pool {self.ratio:g}x the device pool)"


def problem(sglang_version: str) -> str | None:
    """Why live HiCache cannot run on this SGLang release (None when it can)."""
    return hicache_cpu.version_problem(sglang_version)
