"""``--hicache [POLICY]`` and ``--hicache-ratio R``, shared by ``live up``, ``e2e run`` and ``e2e fuzz``."""

from __future__ import annotations

import argparse

from kvalign.errors import UsageError
from kvalign.live.engines.hicache import DEFAULT_POLICY, WRITE_POLICIES, HiCache


def add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hicache", nargs="?", const=DEFAULT_POLICY, default=None, choices=WRITE_POLICIES, metavar="POLICY",
                   help="with --engine sglang-cpu: SGLang's host KV tier (--enable-hierarchical-cache) on the workers "
                        f"that cache prompts, with this write policy ({', '.join(WRITE_POLICIES)}; default "
                        f"{DEFAULT_POLICY})")
    p.add_argument("--hicache-ratio", type=float, default=None, metavar="R",
                   help="with --hicache: host pool = R x the device pool (default 2)")


def hicache_from(args: argparse.Namespace, given: dict | None = None) -> HiCache | None:
    """The run's :class:`HiCache` (a replayed script's ``given`` settings unless the flags say otherwise)."""
    given = given or {}
    policy = args.hicache or given.get("write_policy")
    if policy is None:
        if args.hicache_ratio is not None:
            raise UsageError("--hicache-ratio sizes the host tier: it needs --hicache")
        return None
    ratio = args.hicache_ratio if args.hicache_ratio is not None else given.get("ratio", 2.0)
    try:
        return HiCache(policy, float(ratio))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
