"""HiCache (SGLang's host KV tier) on the live layer's real CPU workers: the settings and their flags.

``--hicache [POLICY]`` on ``kvalign live up``, ``kvalign e2e run`` and ``kvalign e2e fuzz`` starts
every worker that caches prompts (aggregated and prefill workers; a decode worker never keeps a
prefix) with ``--enable-hierarchical-cache --hicache-write-policy POLICY --hicache-ratio R``. The
host tier then runs SGLang's own controller and host pool inside the worker, with the two CUDA-only
pieces stood in (:mod:`kvalign.standins.hicache_cpu`). The IO backend and host layout stay SGLang's
defaults (``kernel``, ``page_first``).

``--storage file`` (with ``--hicache``, on ``sglang-cpu``) adds SGLang's L3 storage tier: the worker
runs ``--hicache-storage-backend file`` into a directory of its own under the run dir (SGLang reads it
from ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``), with ``prefetch_threshold`` one page, because
SGLang's default (256 tokens) refills nothing as short as the fuzz's prompts. The refill's scratch
page is stood in (``storage_scratch_on_cpu``), as in ``tests/e2e/test_real_engine_storage.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvalign.standins import hicache_cpu

#: ``--hicache`` with no policy: SGLang's own default write policy.
DEFAULT_POLICY = "write_through"
WRITE_POLICIES = hicache_cpu.WRITE_POLICIES
#: ``--storage``: SGLang's storage backends that run on this CPU (``file``; the others need a service).
STORAGE_BACKENDS = ("file",)
#: Where SGLang 0.5.23's ``HiCacheFile`` writes its pages (``mem_cache/storage/hicache_file.py``).
STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


@dataclass(frozen=True)
class HiCache:
    """One run's host tier: SGLang's write policy and the host pool's size relative to the device pool."""

    write_policy: str = DEFAULT_POLICY
    #: ``--hicache-ratio``: host pool = ratio x device pool (SGLang's default is 2.0 too; named here so
    #: the host tier's size, and so when it evicts, does not move with SGLang's auto-sizing)
    ratio: float = 2.0
    #: ``--storage``: SGLang's L3 storage backend behind the host tier (None: no storage tier)
    storage: str | None = None

    def __post_init__(self) -> None:
        if self.storage is not None and self.storage not in STORAGE_BACKENDS:
            raise ValueError(f"--storage takes {', '.join(STORAGE_BACKENDS)} (the backends that run on this CPU), "
                             f"got {self.storage!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache takes a write policy of {', '.join(WRITE_POLICIES)}, got {self.write_policy!r}")
        if not self.ratio > 0:
            raise ValueError(f"--hicache-ratio must be > 0, got {self.ratio}")

    def args(self) -> list[str]:
        """The SGLang server flags of a worker that caches prompts."""
        return ["--enable-hierarchical-cache", "--hicache-write-policy", self.write_policy,
                "--hicache-ratio", f"{self.ratio:g}"]

    def storage_args(self, page_size: int) -> list[str]:
        """The storage tier's flags (none without one): a prefetch of one page or more is worth it."""
        if self.storage is None:
            return []
        return ["--hicache-storage-backend", self.storage,
                "--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": page_size})]

    def storage_env(self, directory: Path) -> dict[str, str]:
        """The storage tier's environment for a worker whose pages go to ``directory`` (empty without one)."""
        return {} if self.storage is None else {STORAGE_DIR_ENV: str(directory)}

    def describe(self) -> str:
        return (f"HiCache {self.write_policy} (host pool {self.ratio:g}x the device pool"
                + (f", {self.storage} storage tier)" if self.storage else ")"))


def problem(sglang_version: str) -> str | None:
    """Why live HiCache cannot run on this SGLang release (None when it can)."""
    return hicache_cpu.version_problem(sglang_version)
