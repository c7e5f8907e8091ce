"""``kvalign report``'s engine: one finding, as a Markdown report a maintainer can act on.

A matrix cell says *that* a pair disagrees; an upstream maintainer needs the evidence: the shrunk
counterexample, the bytes the engine put on the wire, what the router indexed from them, what the
engine holds, and where in each release's source the behaviour comes from. :func:`collect` runs in
the pair's own environment (:mod:`kvalign.releases.release_env`, the matrix's per-version cache): it searches the
properties for the finding with Hypothesis, then replays the shrunk example once more through the
real SGLang cache, SGLang's real ZMQ publisher and Dynamo's real relay + ``KvRouter``, recording the
wire frames at the loopback hop between them. :func:`render` turns that JSON into Markdown.

Run as ``python -m kvalign.verify.report.finding CAUSE --mode M --examples N`` (what ``kvalign report`` does in a
subprocess); it prints one JSON object.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvalign.verify.engine.anchors import find_text
from kvalign.model.causes import CREDIT_SKEW, Cause, cause_class

#: The properties searched for a finding, most telling evidence first (``ingest`` has wire bytes).
SEARCH_ORDER = ("ingest", "overlap", "pages", "hash")


@dataclass(frozen=True)
class Anchor:
    """A place in a release's source that a finding comes from, found by text in that release's files.

    ``package`` is the top-level import (``sglang`` / ``dynamo``); ``path`` is relative to it.
    A release where ``text`` does not occur says so in the report instead of quoting a stale line.
    """

    package: str
    path: str
    text: str
    why: str
    dist: str = ""  # the distribution shipping the file, when not the package's usual one


ANCHORS: dict[Cause, tuple[Anchor, ...]] = {
    Cause.LORA_NOT_IN_EVENTS: (
        Anchor("sglang", "srt/managers/schedule_batch.py", "lora_id is concatenated to the extra key",
               "the engine keys a LoRA request's pages by its lora_id: the id is appended to extra_key, "
               "which namespaces every page hash of the request"),
        Anchor("sglang", "srt/mem_cache/events.py", "lora_id=None,",
               "but every BlockStored the cache publishes says lora_id=None"),
        Anchor("sglang", "srt/disaggregation/kv_events.py", "lora_id: Optional[int]",
               "the wire struct has a lora_id field and no lora_name field, so not even the id could name the "
               "adapter to the router"),
        Anchor("dynamo", "sglang/publisher.py", "publisher = KvEventPublisher(",
               "dynamo.sglang relays the engine's ZMQ events into the router as they come: no LoRA context is "
               "added on the way"),
        Anchor("dynamo", "_core.pyi", "lora_name: Optional LoRA adapter name for adapter-aware block hashing.",
               "the router hashes a LoRA block with the adapter's *name* (compute_block_hash_for_seq / "
               "KvEventPublisher.publish_stored take lora_name; the relay itself is compiled Rust in dynamo._core); "
               "an event without a name is hashed as a base-model block", dist="ai-dynamo-runtime"),
    ),
    Cause.SWA_STATE_NOT_REUSABLE: (
        Anchor("sglang", "srt/mem_cache/unified_cache/components/swa.py",
               "When SWA data is evicted from an internal node the node is tombstoned",
               "SGLang evicts a node's sliding-window KV alone and keeps its full-attention pages: no BlockRemoved, "
               "so the router keeps crediting them"),
        Anchor("sglang", "srt/mem_cache/unified_cache/components/swa.py", "def create_match_validator(",
               "while match_prefix stops at the last point where the window's KV survives"),
    ),
    Cause.MAMBA_STATE_NOT_REUSABLE: (
        Anchor("sglang", "srt/mem_cache/unified_cache/components/mamba.py", "def create_match_validator(",
               "SGLang reuses a Mamba tree's prefix only up to a node holding Mamba state (a node end), while the "
               "router credits every full-attention page stored"),
        Anchor("sglang", "srt/mem_cache/unified_cache/components/mamba.py", "def evict_component(",
               "and evicts a node's Mamba state alone, publishing no removal for its full-attention pages"),
    ),
    Cause.STORAGE_TIER_UNCREDITED: (
        Anchor("sglang", "srt/disaggregation/kv_events.py", 'DISK = "DISK"  # L3: SSD / NVMe',
               "the event schema has a storage medium, which the unified cache never publishes"),
        Anchor("sglang", "srt/mem_cache/unified_radix_cache.py", "def write_backup_storage(",
               "a page written to storage is recorded by no event; only the refill's host stores reach the router"),
        Anchor("dynamo", "_core.pyi", "disk_cache_hit_weight: float = 0.25,",
               "the router has a disk tier and would credit a page published with that medium at 0.25 of a device "
               "block: the credit is lost on SGLang's side of the wire, not for want of a router tier",
               dist="ai-dynamo-runtime"),
        Anchor("dynamo", "common/configuration/groups/kv_router_args.py", "'hicache': query Mooncake master directly",
               "Dynamo's other route to L3 credit (--shared-cache-type hicache, experimental) queries a Mooncake "
               "master, so it does not serve the file backend here; kvalign did not drive it (it needs a Mooncake "
               "master) and checked the storage keys against SGLang's own key function instead"),
    ),
    Cause.HOST_CREDIT_NOT_SERVABLE: (
        Anchor("sglang", "srt/mem_cache/unified_radix_cache.py", "self.load_back_threshold = 10",
               "SGLang's init_hicache sets the load-back threshold to 10 KV slots (tokens, or bigrams under EAGLE)"),
        Anchor("sglang", "srt/mem_cache/unified_radix_cache.py", "if (kv_tokens < max(1, self.load_back_threshold)",
               "_load_back_transfers declines a host-only stretch shorter than the threshold; the request re-prefills "
               "those tokens instead of loading them back"),
        Anchor("sglang", "srt/managers/schedule_batch.py", "max_prefix_len = input_len - 1",
               "the scheduler matches at most input_len - 1 tokens of a prompt (logprob_start_len lowers it): the "
               "counterexample's host-only stretch lies inside that cap, so the cap does not explain the re-prefill"),
        Anchor("sglang", "srt/managers/schedule_policy.py", "loaded = self.tree_cache.init_load_back(",
               "the scheduler calls init_load_back with no mem_quota: the threshold is the decline a router could model "
               "(a device pool that stays short after SGLang's eviction on allocation declines too; the prefill budget "
               "defers such a request with NO_TOKEN first)"),
        Anchor("sglang", "srt/disaggregation/kv_events.py", 'CPU = "CPU_PINNED"',
               "every host copy is published as its own BlockStored with medium CPU_PINNED: the router learns that a "
               "page is on host, never whether SGLang would load it back"),
        Anchor("dynamo", "_core.pyi", "host_cache_hit_weight: float = 0.75,",
               "KvRouterConfig credits every host-pinned block past the device prefix at 0.75 of a device block "
               "(best_worker's overlap), whatever the stretch's length", dist="ai-dynamo-runtime"),
        Anchor("dynamo", "common/configuration/groups/kv_router_args.py", 'flag_name="--router-host-cache-hit-weight",',
               "the frontend's flag for that weight (default 0.75); it scales all host credit and cannot express "
               "\"no credit below SGLang's threshold\""),
    ),
    Cause.MM_PAD_WIDTH: (
        Anchor("sglang", "srt/managers/schedule_batch.py", "_MM_WIDE_PAD_MASK = (1 << 62) - 1",
               "SGLang keys an image's tokens by sentinels of up to 62 bits (plus MM_PAD_SHIFT_VALUE)"),
        Anchor("sglang", "srt/managers/schedule_batch.py", "def _compute_pad_values(identity: bytes)",
               "four sentinels per image, from a SHA-256 of the item hash, repeated over the image's tokens (0.5.21 "
               "and before: one value, MM_PAD_SHIFT_VALUE + hash % 2**30)"),
        Anchor("sglang", "srt/managers/schedule_batch.py",
               "self.pad_values = _compute_pad_values(self.hash.to_bytes(8, byteorder=\"big\"))",
               "set_hash, which the tokenizer manager calls with the frontend's hash (mm_hashes), derives them"),
        Anchor("sglang", "srt/managers/tokenizer_manager.py", "item.set_hash(int(hex_hash, 16))",
               "the frontend's hash reaches SGLang's item hash here: same image, same hash on both sides, but "
               "not the same pad values"),
        Anchor("dynamo", "sglang/request_handlers/llm/decode_handler.py", 'mm_hashes_kwargs["mm_hashes"] = forwarded',
               "dynamo.sglang forwards the frontend's per-image hashes to SGLang"),
        Anchor("dynamo", "sglang/_compat.py", "padded_input_ids = MultimodalProcessorOutput.build_padded_input_ids(",
               "and rebuilds SGLang's padded ids after them, with SGLang's own (wide) padding"),
        Anchor("dynamo", "_core.pyi", "image_token_id: Optional model image-placeholder token for exact MM routing.",
               "the frontend and relay are compiled Rust (dynamo._core): the frontend's pad values "
               "(1_000_000 + hash % 2**30) and the relay's u32 token decoding are shown by the replay above, "
               "not by a source line", dist="ai-dynamo-runtime"),
    ),
}


def package_dir(package: str) -> Path | None:
    """Where ``package`` would be imported from (the pair's release first), without importing it."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _enclosing(source: str, line: int) -> str:
    """``Class.function`` (or ``<module>``) whose body holds ``line``."""
    best: tuple[int, str] = (0, "<module>")

    def walk(node: ast.AST, prefix: str) -> None:
        nonlocal best
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                end = getattr(child, "end_lineno", child.lineno)
                if child.lineno <= line <= end and child.lineno >= best[0]:
                    best = (child.lineno, name)
                walk(child, name + ".")

    try:
        walk(ast.parse(source), "")
    except SyntaxError:  # a .pyi with syntax this Python lacks: no name, the line still stands
        return "<module>"
    return best[1]


def locate(anchor: Anchor) -> dict[str, Any]:
    """The anchor in the installed release: file, line, enclosing function, the line itself."""
    root = package_dir(anchor.package)
    dist = anchor.dist or {"sglang": "sglang", "dynamo": "ai-dynamo"}[anchor.package]
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    found: dict[str, Any] = {"package": anchor.package, "dist": dist, "version": version, "path": anchor.path,
                             "text": anchor.text, "why": anchor.why, "line": None}
    at = "file not in this release" if root is None else find_text(root / anchor.path, anchor.text)
    if isinstance(at, str):
        found["missing"] = at
        return found
    source = (root / anchor.path).read_text(encoding="utf-8", errors="replace")
    found.update(line=at[0], function=_enclosing(source, at[0]), source=at[1])
    return found


def _hexable(value: Any) -> Any:
    """A decoded msgpack value as JSON: bytes as hex, tuples as lists, everything else as is."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_hexable(v) for v in value]
    if isinstance(value, dict):
        return {str(_hexable(k)): _hexable(v) for k, v in value.items()}
    return value


def _is_sentinel(payload: Any) -> bool:
    from kvalign.oracles.router_path import sentinel_hash

    if isinstance(payload, dict):
        events = payload.get("events") or []
    else:
        events = payload[1] if isinstance(payload, (list, tuple)) and len(payload) > 1 else []
    hashes = [h for ev in events for h in _event_hashes(ev)]
    return bool(hashes) and all(sentinel_hash(0) <= h < sentinel_hash(1 << 20) for h in hashes)


def _event_hashes(ev: Any) -> list[int]:
    if isinstance(ev, dict):
        return [int(h) for h in ev.get("block_hashes", [])]
    if isinstance(ev, (list, tuple)) and len(ev) > 1 and isinstance(ev[1], list):
        return [int(h) for h in ev[1] if isinstance(h, int)]
    return []


def _wire(frames: list[list[bytes]]) -> list[dict[str, Any]]:
    """Recorded ZMQ messages (sentinel pages left out): frames as hex, topic, seq, payload decoded."""
    import msgpack

    wire = []
    for parts in frames:
        payload = msgpack.unpackb(parts[-1], raw=False, strict_map_key=False)
        if _is_sentinel(payload):
            continue
        wire.append({"frames_hex": [f.hex() for f in parts], "topic": parts[0].decode("utf-8", "replace"),
                     "seq": int.from_bytes(parts[1], "big") if len(parts) > 2 else None, "decoded": _hexable(payload)})
    return wire


def search(cause: Cause, modes: Sequence[str], examples: int) -> tuple[Any, str, str, str, Any]:
    """The first shrunk counterexample any property gives for ``cause``: (mismatch, prop, mode, variant, hasher)."""
    from kvalign.verify.props import by_name
    from kvalign.verify.engine.rows import VARIANTS
    from kvalign.verify.engine.search import run_search
    from kvalign.verify.engine.systems import Systems
    from kvalign.oracles.base import OracleUnavailable
    from kvalign.oracles.dynamo import DynamoRadixTree, load_router_hasher
    from kvalign.oracles.sglang import SglangRadixCache

    hasher = load_router_hasher(None)
    systems = Systems(hasher, lambda p, eagle: SglangRadixCache(p, eagle=eagle), DynamoRadixTree)
    try:
        for prop in SEARCH_ORDER:
            searched = by_name()[prop]  # each a SearchProperty: one Hypothesis search per mode x variant
            try:
                body = searched.body(systems)
            except OracleUnavailable:
                continue
            for mode in modes:
                for variant in VARIANTS:
                    _calls, _failures, found = run_search(body, searched.strategy(mode, variant, None), examples)
                    if found is not None and found.cause is cause:
                        return found, prop, mode, variant, hasher
    finally:
        systems.close()
    raise LookupError(f"no counterexample for {cause.name} in {examples} examples per property x mode x variant")


def replay_ingest(isc: Any, hasher: Any) -> dict[str, Any]:
    """Send ``isc``'s engine events once more through the real path and record every step of it."""
    import msgpack

    from kvalign.model.hashing import U64_MASK, block_hashes
    from kvalign.oracles.router_path import RouterPath
    from kvalign.oracles.sglang import SglangRadixCache, lora_id_for, to_kvalign_event
    from kvalign.verify.engine.properties import engine_batches
    from kvalign.model.events import BlockStored
    from kvalign.model.sglang_keys import event_page_windows

    sc = isc.scenario
    p, eagle = sc.page_size, sc.eagle
    frames: list[list[bytes]] = []

    def record(parts: list[bytes]) -> list[bytes]:
        frames.append(list(parts))
        return parts

    path = RouterPath(transform=record)
    try:
        worker = path.worker(p, eagle)
        if not worker.barrier():
            raise RuntimeError(f"Dynamo {path.version}'s relay never indexed a plain sentinel page")
        base = worker.token_space()
        shift = lambda tokens: [base + t for t in tokens]  # noqa: E731
        start = len(frames)
        cache, batches = engine_batches(lambda ps, e: SglangRadixCache(ps, eagle=e), isc, shift, worker.publisher.clear)
        for raw in batches:
            if raw:
                worker.publisher.publish(raw)
        worker.barrier()
        wire = []
        for parts in frames[start:]:
            payload = msgpack.unpackb(parts[-1], raw=False, strict_map_key=False)
            if _is_sentinel(payload):
                continue
            wire.append({"frames_hex": [f.hex() for f in parts], "topic": parts[0].decode("utf-8", "replace"),
                         "seq": int.from_bytes(parts[1], "big") if len(parts) > 2 else None,
                         "decoded": _hexable(payload)})
        events = [to_kvalign_event(e) for raw in batches for e in raw]
        stored = [e for e in events if isinstance(e, BlockStored)]
        dumped = {h: t for _p, h, t in worker.dump()}
        tenants = sorted({t for _tok, t in sc.inserts if t[0]}, key=str)
        indexed = []
        for ev in stored:
            for h, window in zip(ev.block_hashes, event_page_windows(ev.token_ids, ev.block_size, len(ev.block_hashes))):
                h &= U64_MASK
                indexed.append({
                    "engine_hash": h, "tokens": list(window), "event_lora_id": ev.lora_id,
                    "event_lora_name": ev.lora_name, "event_cache_salt": ev.cache_salt,
                    "router_local_hash": dumped.get(h),
                    "base_model_hash": block_hashes(window, p, eagle=eagle, cache_namespace=ev.cache_salt)[0],
                    "adapter_hashes": {lora: block_hashes(window, p, eagle=eagle, lora_name=lora,
                                                          cache_namespace=ev.cache_salt)[0] for lora, _ns in tenants},
                })
        queries = []
        q_tokens = list(sc.query[0]) or list(sc.inserts[0][0])
        for lora, ns in dict.fromkeys([t for _tok, t in sc.inserts] + [sc.query[1], (None, None)]):
            q = shift(q_tokens)
            queries.append({"lora_name": lora, "cache_salt": ns, "tokens": q,
                            "engine_pages": cache.match(q, lora_name=lora, cache_salt=ns) // p,
                            "router_blocks": worker.overlap(q, lora, ns),
                            "router_query_hashes": [int(h) for h in hasher(q, p, None, lora, eagle, ns)]})
        return {"token_offset": base, "wire": wire, "indexed": indexed, "queries": queries,
                "requests": [{"tokens": shift(tok), "lora_name": t[0], "cache_salt": t[1],
                              "engine_extra_key": lora_id_for(t[0]) if t[0] else None} for tok, t in sc.inserts]}
    finally:
        path.close()


#: Causes only the HiCache state machine finds (kvalign.verify.props.tier.body): searched there, replayed step by step.
TIER_CAUSES = frozenset({Cause.HOST_CREDIT_NOT_SERVABLE})
#: Page sizes the report's servable search draws: below SGLang's load_back_threshold, where the finding holds
#: (4: a page a deployment uses; the report adds the page-4 case with a device prefix, worked_cases).
SERVABLE_REPORT_PAGE_SIZES = (4,)


def search_servable(modes: Sequence[str], examples: int) -> tuple[Any, str, str, str]:
    """The shrunk ``servable`` counterexample: (mismatch, prop, mode, variant)."""
    from kvalign.oracles.router_path import RouterPath
    from kvalign.verify.props.tier.body import TierPath, run_tier_search

    path = TierPath(RouterPath())
    try:
        for mode in modes:
            _calls, _failures, found = run_tier_search(path, eagle=mode == "eagle", lora=False, namespace=False,
                                                       servable=True, examples=examples,
                                                       page_sizes=SERVABLE_REPORT_PAGE_SIZES)
            if found is not None and found.cause is Cause.HOST_CREDIT_NOT_SERVABLE:
                return found, "servable", mode, "base"
    finally:
        path.close()
        path.path.close()
    raise LookupError(f"no counterexample for HOST_CREDIT_NOT_SERVABLE in {examples} state-machine runs per mode")


def _engine_for(example: dict[str, Any]) -> Any:
    """A fresh HiCache engine with the example's page size, write policy, host size and tree core
    (the example names the core by its class; the engine is built by kind)."""
    from kvalign.oracles.hicache import HiCacheEngine, available_cores

    host = 1 << 20 if example["host_tokens"] == "unbounded" else int(example["host_tokens"])
    device = example.get("device_tokens", "unbounded")
    for kind in available_cores():
        engine = HiCacheEngine(example["page_size"], eagle=example["eagle"], core=kind, policy=example["policy"],
                               host_tokens=host, device_tokens=None if device == "unbounded" else int(device))
        if engine.core == example["core"]:
            return engine
    raise RuntimeError(f"this SGLang has no tree core {example['core']!r}")


def replay_servable(example: dict[str, Any]) -> dict[str, Any]:
    """Run the shrunk state-machine steps once more through the real path, recording the wire and, after
    every step, SGLang's residency of the admitted prompt against the router's per-tier answer."""
    import msgpack

    from kvalign.oracles.router_path import RouterPath
    from kvalign.verify.props.tier.servable import judge
    from kvalign.verify.props.tier.body import TierPath, tenant_kwargs

    frames: list[list[bytes]] = []

    def record(parts: list[bytes]) -> list[bytes]:
        frames.append(list(parts))
        return parts

    tp = TierPath(RouterPath(transform=record))
    try:
        worker, tap = tp.worker(example["page_size"], example["eagle"])
        base = worker.token_space()
        shift = lambda tokens: [base + t for t in tokens]  # noqa: E731
        engine = _engine_for(example)
        engine.take_raw_events()
        steps = [tuple(s) for s in example["steps"]]
        prompt, tenant = shift(list(steps[-1][1])), tuple(steps[-1][2])
        start, table, outcome = len(frames), [], None
        for i, step in enumerate(steps):
            kind = step[0]
            if kind in ("cache", "admit"):  # a request served by SGLang's scheduler code
                query = shift(list(step[1]))
                tiers = tp.path.query_tiers(worker.router, query, *step[2])
                best = tp.path.call(worker.router.best_worker, query, **tenant_kwargs(tuple(step[2])))
                admission = engine.serve(query, *step[2])
                if i == len(steps) - 1:
                    j = judge(admission, tiers, engine.page_size, eagle=engine.eagle,
                              threshold=engine.load_back_threshold, best_worker_overlap=best[2],
                              host_weight=tp.path.host_weight)
                    if j.cause is not Cause.HOST_CREDIT_NOT_SERVABLE:
                        raise RuntimeError(f"the replay did not reproduce HOST_CREDIT_NOT_SERVABLE: {j.detail}")
                    outcome = {"admission": admission.as_dict(), "router_tiers": tiers, "best_worker_overlap": best[2],
                               "load_back_threshold": engine.load_back_threshold, "host_weight": tp.path.host_weight,
                               "host_in_cap": j.host_in_cap,
                               "capped_blocks": j.capped_blocks}
                    break
                if "+transfers_done" in step:
                    engine.transfers_done()
            elif kind == "transfers_done":
                engine.transfers_done()
            elif kind == "evict_device":
                engine.evict(step[1] * engine.page_size)
            elif kind == "evict_host":
                engine.evict_host(step[1] * engine.page_size)
            elif kind == "flush":
                engine.reset()
            events = engine.take_raw_events()
            if events:
                worker.publisher.publish(events)
            if tp.settle(worker, tap) is not None:
                raise RuntimeError(f"the router did not settle after step {i + 1} {step!r}")
            held = engine.residency(prompt, *tenant)
            tiers = tp.path.query_tiers(worker.router, prompt, *tenant)
            table.append({"step": list(step), "events": [f"{type(e).__name__}[{getattr(e.medium, 'value', e.medium)}, "
                                                         f"{len(e.block_hashes)} page(s)]" if hasattr(e, "block_hashes")
                                                         else type(e).__name__ for e in events],
                          "engine_device": held.device, "engine_host": held.host,
                          "router_device": tiers["device_blocks"], "router_host": tiers["host_pinned_extension_blocks"]})
        wire = []
        for parts in frames[start:]:
            payload = msgpack.unpackb(parts[-1], raw=False, strict_map_key=False)
            if _is_sentinel(payload):
                continue
            wire.append({"frames_hex": [f.hex() for f in parts], "topic": parts[0].decode("utf-8", "replace"),
                         "seq": int.from_bytes(parts[1], "big") if len(parts) > 2 else None,
                         "decoded": _hexable(payload)})
        if outcome is None:
            raise RuntimeError("the example does not end in an admitted request")
        return {"token_offset": base, "prompt": prompt, "steps": table, "wire": wire, "outcome": outcome,
                "engine": {"page_size": engine.page_size, "core": engine.core, "policy": engine.policy,
                           "eagle": engine.eagle, "device_tokens": example.get("device_tokens", "unbounded")}}
    finally:
        tp.close()
        tp.path.close()


def collect(cause: Cause, modes: Sequence[str], examples: int) -> dict[str, Any]:
    """Everything the report says, from the releases importable here (run inside the pair's environment)."""
    from kvalign.verify.engine.property import plain as _plain

    from kvalign.verify.props.mm import report as report_mm
    from kvalign.verify.props.mm.body import describe as describe_mm

    if cause in report_mm.MM_CAUSES:
        found, prop, mode, variant, handles = report_mm.search_mm(cause, modes, examples)
        try:
            return {"cause": cause.name, "cause_text": cause.value, "class": cause_class(cause), "property": prop,
                    "mode": mode, "variant": variant,
                    "detail": found.detail, "counterexample": describe_mm(found.example),
                    "versions": {d: _version(d) for d in ("ai-dynamo", "ai-dynamo-runtime", "sglang")},
                    "anchors": [locate(a) for a in ANCHORS.get(cause, ())],
                    "mm_replay": report_mm.replay_mm(found.example, handles, _wire)}
        finally:
            report_mm.close(handles)
    from kvalign.verify.props.hybrid import report as report_hybrid
    from kvalign.verify.props.storage import report as report_storage

    if cause in TIER_CAUSES:
        found, prop, mode, variant = search_servable(modes, examples)
        hasher = None
    elif cause in report_hybrid.CAUSES:
        found, prop, mode, variant = report_hybrid.search(cause, modes, examples)
        hasher = None
    elif cause in report_storage.CAUSES:
        found, prop, mode, variant = report_storage.search(cause, modes, examples)
        hasher = None
    else:
        found, prop, mode, variant, hasher = search(cause, modes, examples)
    out: dict[str, Any] = {
        "cause": cause.name, "cause_text": cause.value, "class": cause_class(cause), "property": prop, "mode": mode,
        "variant": variant,
        "detail": found.detail, "counterexample": _plain(found.example),
        "versions": {d: _version(d) for d in ("ai-dynamo", "ai-dynamo-runtime", "sglang")},
        "anchors": [locate(a) for a in ANCHORS.get(cause, ())],
    }
    if cause is Cause.STORAGE_TIER_UNCREDITED:  # counted while the search goes on, not raised: not shrunk
        out.update(storage_impact(mode, variant, found.example), shrunk=False)
    if prop == "hybrid":
        out.update(hybrid_impact(cause, mode, variant, out["counterexample"]))
    if prop == "ingest":
        out["replay"] = replay_ingest(found.example, hasher)
    if prop == "servable":
        out["condition"] = found.condition
        out["admission"] = getattr(found, "admission", None)
        out.update(measured_impact(cause, prop, mode, variant, out["admission"]))
        out["tier_replay"] = replay_servable(found.example)
        from kvalign.verify.props.tier.servable_sequence import worked_cases

        out["worked_cases"] = worked_cases()
    return out


def measured_impact(cause: Cause, prop: str, mode: str, variant: str, admission: dict[str, Any] | None) -> dict[str, Any]:
    """A credit skew's bound and the real router's measured choice on the counterexample (as ``check`` prints them)."""
    if cause_class(cause) != CREDIT_SKEW:
        return {}
    from kvalign.oracles.router_path import RouterPath
    from kvalign.verify.engine.impact import assess_skew
    from kvalign.verify.engine.rows import RowResult

    row = RowResult(prop, mode, variant, cause=cause.value, cause_name=cause.name, admission=admission)
    with RouterPath() as path:
        assess_skew(row, path, {})
    return {"bound_tokens": row.bound_tokens, "changes_worker": row.changes_worker, "impact": row.impact,
            "routing": row.routing}


def storage_impact(mode: str, variant: str, example: dict[str, Any]) -> dict[str, Any]:
    """The storage finding's routing impact, measured at its counterexample as ``check`` measures it."""
    from kvalign.oracles.router_path import RouterPath
    from kvalign.verify.props.storage.impact import assess_storage
    from kvalign.verify.engine.rows import RowResult

    c = Cause.STORAGE_TIER_UNCREDITED
    row = RowResult("storage", mode, variant, cause=c.value, cause_name=c.name, counterexample=example)
    with RouterPath() as path:
        assess_storage(row, path)
    return {"changes_worker": row.changes_worker, "impact": row.impact, "routing": row.routing}


def hybrid_impact(cause: Cause, mode: str, variant: str, example: dict[str, Any]) -> dict[str, Any]:
    """A hybrid finding's routing impact, measured at its counterexample as ``check`` measures it."""
    from kvalign.oracles.router_path import RouterPath
    from kvalign.verify.props.hybrid.impact import assess_hybrid
    from kvalign.verify.engine.rows import RowResult

    row = RowResult("hybrid", mode, variant, cause=cause.value, cause_name=cause.name, counterexample=example)
    with RouterPath() as path:
        assess_hybrid(row, path)
    return {"changes_worker": row.changes_worker, "impact": row.impact, "routing": row.routing}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fence(text: str, lang: str = "") -> str:
    return f"```{lang}\n{text}\n```"


def render(data: dict[str, Any], command: str, shipped: str | None) -> str:
    """The Markdown report for one collected finding; ``command`` reproduces it, ``shipped`` is the SGLang the
    Dynamo release's ``ai-dynamo[sglang]`` extra pins (the report opens with the pair's status)."""
    from kvalign.verify.report.finding_status import opening

    v = data["versions"]
    pair = f"ai-dynamo {v['ai-dynamo']} (ai-dynamo-runtime {v['ai-dynamo-runtime']}) × sglang {v['sglang']}"
    out = [f"# {data['cause']}: {data['cause_text']}", "", *opening(data, shipped),
           f"**Pair:** {pair}.  ",
           f"**Found by:** kvalign's `{data['property']}` property, {data['mode']} mode, `{data['variant']}` variant "
           f"(Hypothesis search, {'shrunk' if data.get('shrunk', True) else 'the first example with the largest, not shrunk'}).  ",
           f"**Reproduce:** `{command}`", "",
           "## What goes wrong", "", data["detail"], "",
           f"## {'Shrunk counterexample' if data.get('shrunk', True) else 'Counterexample'}", "", _fence(json.dumps(data["counterexample"], ensure_ascii=False), "json"), ""]
    replay = data.get("replay")
    if replay:
        out += ["The replay below sends this example once more through the real path: SGLang's "
                "`UnifiedRadixCache` → SGLang's `ZmqEventPublisher` → a 127.0.0.1 hop (recorded here) → Dynamo's "
                f"`KvEventPublisher` relay → `KvRouter`. Token ids are offset by {replay['token_offset']} (each "
                "example gets its own token range in the long-lived router).", "",
                "## Requests the engine cached", "",
                "| # | tokens | lora_name | cache_salt | SGLang extra_key (the LoRA id) |", "|---|---|---|---|---|"]
        for i, r in enumerate(replay["requests"], 1):
            out.append(f"| {i} | {r['tokens']} | {r['lora_name']!r} | {r['cache_salt']!r} | {r['engine_extra_key']!r} |")
        out += ["", "## Event bytes on the wire, as decoded", ""]
        for i, w in enumerate(replay["wire"], 1):
            out += [f"Message {i} (topic {w['topic']!r}, seq {w['seq']}): frames (hex)", "",
                    _fence("\n".join(w["frames_hex"])), "", "decoded (msgpack):", "",
                    _fence(json.dumps(w["decoded"], ensure_ascii=False), "json"), ""]
        out += ["## What the router indexed", "",
                "| engine block hash | page tokens | event lora_id | event lora_name | router's local hash | "
                "= base-model hash? | adapter hash(es) |", "|---|---|---|---|---|---|---|"]
        for b in replay["indexed"]:
            local = b["router_local_hash"]
            out.append(f"| {b['engine_hash']} | {b['tokens']} | {b['event_lora_id']!r} | {b['event_lora_name']!r} | "
                       f"{'not indexed' if local is None else local} | {'yes' if local == b['base_model_hash'] else 'no'} | "
                       + ", ".join(f"{k}: {h}" for k, h in b["adapter_hashes"].items()) + " |")
        out += ["", "## What the engine holds vs what the router answers", "",
                "| query tenant (lora_name, cache_salt) | SGLang `match_prefix` (pages) | router overlap (blocks) |",
                "|---|---|---|"]
        for q in replay["queries"]:
            out.append(f"| ({q['lora_name']!r}, {q['cache_salt']!r}) | {q['engine_pages']} | {q['router_blocks']} |")
        out.append("")
    if data.get("routing"):
        out += _render_routing(data["routing"])
    if data.get("mm_replay"):
        from kvalign.verify.props.mm.report import render_mm_replay

        out += render_mm_replay(data["mm_replay"])
    tier = data.get("tier_replay")
    if tier:
        out += _render_tier_replay(tier, data.get("condition"))
    if data.get("worked_cases"):
        out += _render_worked_cases(data["worked_cases"])
    anchors = data.get("anchors") or []
    out += ["## Source lines responsible", ""]
    if not anchors:
        out.append(f"kvalign records no source anchors for {data['cause']} yet.")
    for a in anchors:
        where = f"`{a['package']}/{a['path']}`"
        if a.get("missing"):
            out.append(f"- {a['dist']} {a['version']}: {where}: {a['missing']} (looked for `{a['text']}`) — {a['why']}.")
        else:
            out.append(f"- {a['dist']} {a['version']}: {where}:{a['line']} in `{a['function']}`: `{a['source']}` — "
                       f"{a['why']}.")
    out += ["", "---", "Generated by `kvalign report` from real runs of the wheels named above."]
    return "\n".join(out) + "\n"


def _picks(t: dict[str, Any]) -> str:
    p0, p1 = t["picks"]
    verdict = "tie" if t["tie"] else ("first" if p0 > p1 else "other") + (", reuses less" if t["changed"] else "")
    return f"{p0} / {p1} ({verdict})"


def _render_routing(routing: dict[str, Any]) -> list[str]:
    """The measurements behind the routing-impact line: per k, the real router's picks over repeated routings
    of one state (both non-zero: a tie it broke at random, never a flip) and what each engine then reused."""
    out = ["## Routing, measured", "",
           "Two candidates under one real `KvRouter` (two data-parallel ranks): the first holds the finding's state, "
           "the other the prompt's first k pages. `picks`: how often the router's `best_worker` chose the first / "
           "the other over repeated routings of the same state (both non-zero is a tie, broken at random: never "
           "counted as a flip; a stray pick or two beside the majority is not a tie); `reused`: what each engine "
           "then reused.", ""]
    for name, m in routing.items():
        if isinstance(m, str):
            out += [f"**{name.replace('_', ' ')}:** {m}.", ""]
            continue
        if "without_events" in m:  # a storage measurement, without and with the storage pages as DISK events
            w, r = m["without_events"], m["disk_events"]
            out += [f"### {name.replace('_', ' ')}: page size {w['page_size']}, {w['storage_pages']} page(s) in storage "
                    f"only, prefetch_threshold {w['prefetch_threshold']} tokens, {'shared' if w['shared'] else 'private'} "
                    f"storage, disk weight {r['disk_weight']:g}", "",
                    "| k | as SGLang publishes: picks | reused | with DISK events: picks | reused | wrong choice owed to |",
                    "|---|---|---|---|---|---|"]
            for a, b in zip(w["trials"], r["trials"], strict=True):
                owed = ("the missing events" if a["k"] in m["missing_events_k"] else
                        "the disk weight" if a["k"] in m["disk_weight_k"] else "a tie" if a["k"] in m["tie_k"] else "-")
                out.append(f"| {a['k']} | {_picks(a)} | {a['reused'][0]} vs {a['reused'][1]} | {_picks(b)} | "
                           f"{b['reused'][0]} vs {b['reused'][1]} | {owed} |")
        else:  # a hybrid measurement
            said = (f" (the router credits {m['credited']} block(s), SGLang reuses {m['reusable']} page(s))"
                    if "credited" in m else "")
            out += [f"### {name.replace('_', ' ')}: {m['state']}{said}", "", "| k | picks | reused |", "|---|---|---|"]
            out += [f"| {t['k']} | {_picks(t)} | {t['reused'][0]} vs {t['reused'][1]} |" for t in m["trials"]]
        out.append("")
    return out


def _render_tier_replay(tier: dict[str, Any], condition: str | None) -> list[str]:
    """The HiCache replay's sections: the steps with both sides' answer after each, the admitted
    request's outcome, and the wire."""
    e, o = tier["engine"], tier["outcome"]
    out = ["The replay below runs these steps once more through the real path: SGLang's `UnifiedRadixCache` with "
           f"HiCache on ({e['core']}, write policy `{e['policy']}`, page size {e['page_size']}; SGLang's own "
           "`init_hicache`; each request served by SGLang's own scheduler code, `Req`, `PrefillAdder.add_one_req`, "
           "`ScheduleBatch.prepare_for_extend` and `release_kv_cache` on SGLang's device allocator: "
           "kvalign/oracles/admission.py; only the device↔host transfer path and the scheduler's server and model "
           "config stood in: kvalign/standins/hicache.py, kvalign/standins/scheduler.py) → SGLang's "
           "`ZmqEventPublisher` → a 127.0.0.1 hop (recorded here) → Dynamo's `KvEventPublisher` relay → `KvRouter`. "
           f"Token ids are offset by {tier['token_offset']}.", "",
           "## Each step: where SGLang holds the prompt, what the router credits", "",
           f"Prompt of the admitted request: {tier['prompt']}.", "",
           "| # | step | SGLang's events | SGLang device pages | SGLang host-only pages | router device blocks | "
           "router host blocks |", "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(tier["steps"], 1):
        out.append(f"| {i} | `{json.dumps(row['step'])}` | {', '.join(row['events']) or '-'} | {row['engine_device']} | "
                   f"{row['engine_host']} | {row['router_device']} | {row['router_host']} |")
    t, a = o["router_tiers"], o["admission"]
    unit = "bigram" if e.get("eagle") else "token"
    out += ["", "## The admitted request", "",
            f"- The router credits {t['device_blocks']} device + {t['host_pinned_extension_blocks']} host block(s) "
            f"(`get_overlap_scores`); `best_worker` answers overlap {o['best_worker_overlap']}.",
            f"- SGLang's scheduler, as it admits the request (`Req.init_next_round_input`, `PrefillAdder.add_one_req`): "
            f"a {a['prompt_tokens']}-token prompt, of which it matches at most {a['max_prefix_tokens']} tokens "
            "(`Req._compute_max_prefix_len`: input_len - 1); it matches "
            f"{a['device_tokens']} {unit}(s) on device and {a['host_only_tokens']} on host only past them, so "
            f"prompt_tokens - 1 = {a['prompt_tokens'] - 1} >= device_tokens + host_only_tokens = "
            f"{a['device_tokens'] + a['host_only_tokens']}: the cap does not explain it.",
            f"- The host-only stretch ({a['host_only_tokens']} {unit}s, {o['host_in_cap']} credited block(s)) is below "
            f"its `load_back_threshold` ({o['load_back_threshold']}): `init_load_back` loads back {a['loaded_tokens']} "
            f"and the request re-prefills them; SGLang reports cached_tokens {a['cached_tokens']}.", ""]
    if condition:
        out += [f"This holds {condition}.", ""]
    out += ["## Event bytes on the wire, as decoded", ""]
    for i, w in enumerate(tier["wire"], 1):
        out += [f"Message {i} (topic {w['topic']!r}, seq {w['seq']}): frames (hex)", "",
                _fence("\n".join(w["frames_hex"])), "", "decoded (msgpack):", "",
                _fence(json.dumps(w["decoded"], ensure_ascii=False), "json"), ""]
    return out


def _render_worked_cases(cases: list[dict[str, Any]]) -> list[str]:
    """The same finding in a case with pages on device before the host-only stretch, on every tree core and mode."""
    out = ["## The same at page 4, with a device prefix, on both tree cores, plain and EAGLE", "",
           "Steps (`kvalign.verify.props.tier.servable_sequence.worked_case`, each request served by SGLang's own scheduler code): 8 tokens "
           "then 16 tokens cached (the second extends the first; under EAGLE one token more each), device pressure "
           "evicts the 8-token leaf to host, then a 21-token prompt (22 under EAGLE) extending the second arrives.", "",
           "| mode | tree core | prompt_tokens | SGLang's cap | device_tokens | host_only_tokens | loaded_tokens | "
           "cached_tokens | router device + host blocks | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        a = c["admission"]
        out.append(f"| {c['mode']} | {c['core']} | {a['prompt_tokens']} | {a['max_prefix_tokens']} | {a['device_tokens']} | "
                   f"{a['host_only_tokens']} | {a['loaded_tokens']} | {a['cached_tokens']} | {c['router_device']} + "
                   f"{c['router_host']} | {c['cause'] or 'served as credited'} |")
    return out + ["", "In each, prompt_tokens - 1 >= device_tokens + host_only_tokens (the scheduler's cap does not "
                  "reach the host-only stretch) and loaded_tokens < host_only_tokens: SGLang re-prefills the 8 slots "
                  "the router credits as 2 host blocks.", ""]


def main(argv: Sequence[str] | None = None) -> int:
    """The in-pair collector: one JSON object on stdout, or one error line on stderr (exit 2)."""
    ap = argparse.ArgumentParser(prog="python -m kvalign.verify.report.finding")
    ap.add_argument("cause", choices=[c.name for c in Cause])
    ap.add_argument("--mode", action="append", choices=("plain", "eagle"))
    ap.add_argument("--examples", type=int, default=30)
    args = ap.parse_args(argv)
    try:
        data = collect(Cause[args.cause], tuple(args.mode or ("plain", "eagle")), args.examples)
    except LookupError as exc:
        print(f"not found: {exc}", file=sys.stderr)
        return 3
    json.dump(data, sys.stdout, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o),
              ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
