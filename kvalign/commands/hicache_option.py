"""``--hicache [POLICY]`` and ``--hicache-ratio R``, shared by ``live up``, ``e2e run`` and ``e2e fuzz``;
``--storage BACKEND`` (``e2e fuzz`` only: the one command that judges a storage refill)."""

from __future__ import annotations

import argparse

from kvalign.errors import UsageError
from kvalign.live.engines.hicache import DEFAULT_POLICY, STORAGE_BACKENDS, WRITE_POLICIES, HiCache


def add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hicache", nargs="?", const=DEFAULT_POLICY, default=None, choices=WRITE_POLICIES, metavar="POLICY",
                   help="with --engine sglang-cpu: SGLang's host KV tier (--enable-hierarchical-cache) on the workers "
                        f"that cache prompts, with this write policy ({', '.join(WRITE_POLICIES)}; default "
                        f"{DEFAULT_POLICY})")
    p.add_argument("--hicache-ratio", type=float, default=None, metavar="R",
                   help="with --hicache: host pool = R x the device pool (default 2)")


def add_storage(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage", choices=STORAGE_BACKENDS, default=None, metavar="BACKEND",
                   help="with --hicache on --engine sglang-cpu: SGLang's L3 storage tier behind the host tier "
                        "(--hicache-storage-backend; file: a directory per worker under the run dir)")


def hicache_from(args: argparse.Namespace, given: dict | None = None) -> HiCache | None:
    """The run's :class:`HiCache` (a replayed script's ``given`` settings unless the flags say otherwise)."""
    given = given or {}
    policy = args.hicache or given.get("write_policy")
    storage = getattr(args, "storage", None) or given.get("storage")
    if policy is None:
        if args.hicache_ratio is not None:
            raise UsageError("--hicache-ratio sizes the host tier: it needs --hicache")
        if storage is not None:
            raise UsageError("--storage puts a storage tier behind SGLang's host tier: it needs --hicache")
        return None
    ratio = args.hicache_ratio if args.hicache_ratio is not None else given.get("ratio", 2.0)
    try:
        return HiCache(policy, float(ratio), storage)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
