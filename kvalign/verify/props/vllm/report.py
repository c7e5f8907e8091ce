"""What ``kvalign report`` says of a vLLM finding: the finding replayed once on vLLM's real ``KVCacheManager``
behind Dynamo's real relay and ``KvRouter`` (vLLM's events as published, what the router indexed, each
request's reuse against the router's credit), its routing impact on the real router pair
(:mod:`kvalign.verify.props.vllm.impact`), and the source lines it comes from in the pinned releases.

Everything here is measured on the installed Dynamo (``.venv``) and the pinned vLLM (its own environment,
:mod:`kvalign.releases.vllm_env`); :mod:`kvalign.verify.report.vllm_finding` renders it.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvalign.model.causes import Cause, cause_class
from kvalign.verify.engine.anchors import find_text
from kvalign.model.vllm_keys import dynamo_salt
from kvalign.verify.props.vllm.impact import BLOCKS, FINDING_ENV, RAW_SALT, TAIL, measure

CAUSES = frozenset(FINDING_ENV)
BLOCK_SIZE = 16
#: what shows each finding, for the report's "Found by" line
FOUND_BY: dict[Cause, str] = {
    Cause.VLLM_BYTES_HASHES_DROPPED: ("`kvalign check --engine vllm --all`'s `hashes` `bytes` row (the opt-in property "
                                      "`vllm_bytes`; Hypothesis search, shrunk), which fails `check --all` (exit 1)"),
    Cause.VLLM_SALT_UNPREFIXED: ("tests/unit/oracles/test_vllm_tenants.py "
                                 "(`test_finding_a_salt_without_dynamos_prefix_is_ignored_by_the_router`) and the replay "
                                 "below; no `check` row drives it: its `tenants` rows hand vLLM each salt as "
                                 "`dynamo.vllm`'s handler does, prefixed"),
}

#: who can reach each finding in a ``dynamo.vllm`` deployment, read from the pinned Dynamo's own paths: a report says
#: it first, so a hazard no shipped path reaches is never read as a finding of the pair.
REACH: dict[Cause, str] = {
    Cause.VLLM_BYTES_HASHES_DROPPED: ("any `dynamo.vllm` worker started with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` in "
                                      "its environment: `dynamo.vllm` neither sets nor checks it, and nothing is logged"),
    Cause.VLLM_SALT_UNPREFIXED: ("**latent, not reached through `dynamo.vllm` 1.6.1**: every path of its handler that "
                                 "hands vLLM a salt (`nvext.cache_salt`, `extra_args.nvext`, `extra_args.vllm_tito`) adds "
                                 "the prefix (`handlers.py` `_apply_nvext_cache_salt`); only a salt set another way (a "
                                 "client of vLLM's own server on a worker the router also indexes) meets it, so it is a "
                                 "hazard for such deployments, not a finding of the shipped path"),
}


@dataclass(frozen=True)
class Anchor:
    """A line of a pinned release's source the finding comes from, found by its text (``root``: ``vllm`` in vLLM's
    environment, ``dynamo`` in kvalign's)."""

    root: str
    path: str
    text: str
    why: str


ANCHORS: dict[Cause, tuple[Anchor, ...]] = {
    Cause.VLLM_BYTES_HASHES_DROPPED: (
        Anchor("vllm", "envs.py", '"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": lambda: bool(',
               "vLLM's setting, on (int hashes) by default; 0 publishes block hashes as bytes"),
        Anchor("vllm", "v1/core/kv_cache_utils.py", "if not envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:",
               "maybe_convert_block_hash returns the 32-byte hash itself when the setting is 0 (ExternalBlockHash "
               "is bytes | int)"),
        Anchor("dynamo", "vllm/main.py", "kv_block_size=kv_event_block_size,",
               "dynamo.vllm relays vLLM's ZMQ events as they come, and neither sets nor checks the setting"),
        Anchor("dynamo", "vllm/tests/test_vllm_dcp_kv_events.py",
               'monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")',
               "Dynamo's own vLLM event test pins the int encoding; the relay (compiled Rust in dynamo._core) "
               "takes block hashes as 64-bit ints (the replay above: a bytes-hashed batch indexes nothing)"),
    ),
    Cause.VLLM_SALT_UNPREFIXED: (
        Anchor("vllm", "v1/core/kv_cache_utils.py", '[("cache_salt", request.cache_salt)]',
               "vLLM keys a request's first block by any cache_salt it gets, so salted blocks are a tenant's own"),
        Anchor("dynamo", "vllm/handlers.py", '_DYNAMO_CACHE_SALT_PREFIX = "dynamo-cache-salt:"',
               "the relay recovers a namespace from extra_keys only behind this prefix (it must match "
               "DYNAMO_CACHE_SALT_PREFIX in lib/kv-router/src/zmq_wire/extra_keys.rs)"),
        Anchor("dynamo", "vllm/handlers.py", 'prompt["cache_salt"] = f"{_DYNAMO_CACHE_SALT_PREFIX}{cache_salt}"',
               "dynamo.vllm's handler adds the prefix to nvext.cache_salt: a salt reaching vLLM any other way (a "
               "client of vLLM's own server, another front end on the same workers) has none"),
    ),
}


def _roots() -> dict[str, Path]:
    import importlib.util

    from kvalign.releases.vllm_env import vllm_dir

    spec = importlib.util.find_spec("dynamo")
    return {"vllm": vllm_dir() / "vllm", "dynamo": Path(list(spec.submodule_search_locations)[0]) if spec else Path()}


def locate(anchor: Anchor, roots: dict[str, Path]) -> dict[str, Any]:
    """The anchor's file, line and source in the pinned release, or what is missing."""
    found: dict[str, Any] = {"root": anchor.root, "path": anchor.path, "text": anchor.text, "why": anchor.why, "line": None}
    at = find_text(roots[anchor.root] / anchor.path, anchor.text)
    if isinstance(at, str):
        return {**found, "missing": at}
    return {**found, "line": at[0], "source": at[1]}


def _plain(value: Any) -> Any:
    """An event field as JSON: bytes as hex."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def replay(cause: Cause, path: Any) -> dict[str, Any]:
    """The finding once on one vLLM worker behind the real relay and router: the prompt vLLM served, vLLM's events
    as published, what the router indexed, and per request vLLM's reuse against the router's credit."""
    from kvalign.oracles.vllm_router import vllm_worker

    b = BLOCK_SIZE
    worker = vllm_worker(path, b, 64, env=FINDING_ENV[cause])
    try:
        base = 1 << 23
        prompt = list(range(base, base + BLOCKS * b)) + [base + 999] * TAIL
        salted = cause is Cause.VLLM_SALT_UNPREFIXED
        worker.engine.prefill(prompt, cache_salt=RAW_SALT if salted else None)
        events = worker.sync()
        # (request, the salt vLLM gets, the namespace the router is asked with)
        requests = [("unsalted", None, None)]
        if salted:
            requests += [(f"cache_salt {RAW_SALT!r} (as stored, no prefix)", RAW_SALT, RAW_SALT),
                         (f"nvext.cache_salt {RAW_SALT!r} through dynamo.vllm", dynamo_salt(RAW_SALT), RAW_SALT)]
        return {"block_size": b, "prompt_tokens": len(prompt), "token_range": [base, base + 999],
                "served_with": {"cache_salt": RAW_SALT if salted else None, "env": FINDING_ENV[cause] or {}},
                "events": [_plain(e) for e in events],
                "indexed": [{"parent": p, "engine_hash": h, "router_local_hash": loc} for p, h, loc in worker.dump()],
                "requests": [{"request": name, "vllm_salt": salt, "router_namespace": ns,
                              "vllm_reuses": worker.engine.match(prompt, cache_salt=salt),
                              "router_blocks": worker.overlap(prompt, cache_namespace=ns)}
                             for name, salt, ns in requests]}
    finally:
        worker.close()


def collect(cause: Cause) -> dict[str, Any]:
    """Everything the report says of ``cause`` (one of :data:`CAUSES`), measured here."""
    from kvalign.oracles.router_path import RouterPath
    from kvalign.releases.vllm_env import VLLM_DIST, VLLM_VERSION

    if cause not in CAUSES:
        raise ValueError(f"{cause.name} is not a vLLM finding kvalign reports (one of {sorted(c.name for c in CAUSES)})")
    with RouterPath() as path:
        evidence = replay(cause, path)
        impact = measure(cause, path, BLOCK_SIZE)
    roots = _roots()
    return {"cause": cause.name, "cause_text": cause.value, "class": cause_class(cause), "found_by": FOUND_BY[cause],
            "reach": REACH[cause],
            "versions": {"ai-dynamo": importlib.metadata.version("ai-dynamo"),
                         "ai-dynamo-runtime": importlib.metadata.version("ai-dynamo-runtime"),
                         "vllm_dist": VLLM_DIST, "vllm": VLLM_VERSION},
            "replay": evidence, "impact": impact.says(), "changes_worker": impact.changes_worker,
            "routing": {"counterexample": impact.as_dict()},
            "anchors": [locate(a, roots) for a in ANCHORS[cause]]}
