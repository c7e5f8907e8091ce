"""``kvalign report`` for multimodal findings: the ``mm`` search, then the example replayed with its wire bytes.

The ``mm`` property finds the shrunk image scenario; the replay sends its first request once more
through the real path, recording each step: what Dynamo's frontend handed the router (the routing
sequence and the image hashes it forwarded), what SGLang keyed (its padded token ids, each image's
hash and pad values), the event batch on the 127.0.0.1 hop between SGLang's publisher and Dynamo's
relay (decoded), what the router indexed of it, and both sides' answer for the request sent again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from kvalign.model.causes import Cause

#: Causes the ``mm`` property finds (the others are its controls' and have no upstream report).
MM_CAUSES = frozenset({Cause.MM_PAD_WIDTH, Cause.MM_PAD_VALUES, Cause.MM_PLACEHOLDER_COUNT, Cause.MM_HASH_NOT_FORWARDED,
                       Cause.MM_ROUTING_SKIPPED, Cause.MM_EAGLE_WINDOW, Cause.MM_IMAGE_REUSED})

def search_mm(cause: Cause, modes: Sequence[str], examples: int) -> tuple[Any, str, str, str, Any]:
    """The shrunk ``mm`` counterexample for ``cause``: (mismatch, prop, mode, variant, mm systems)."""
    from kvalign.oracles.dynamo import DynamoRadixTree, load_router_hasher
    from kvalign.oracles.sglang import SglangRadixCache
    from kvalign.verify.engine.systems import Systems
    from kvalign.verify.props.mm.body import close_mm_systems, open_mm_systems, run_mm_search
    from kvalign.verify.props.mm.strategies import MM_PAGE_SIZES

    make_cache = lambda p, eagle: SglangRadixCache(p, eagle=eagle)  # noqa: E731
    systems = Systems(load_router_hasher(None), make_cache, DynamoRadixTree)
    mm = open_mm_systems(systems, MM_PAGE_SIZES)
    try:
        for mode in modes:
            _calls, _failures, found = run_mm_search(mm, make_cache, eagle=mode == "eagle", examples=examples)
            if found is not None and found.cause is cause:
                return found, "mm", mode, "base", (systems, mm)
    except BaseException:
        close_mm_systems(mm)
        systems.close()
        raise
    close_mm_systems(mm)
    systems.close()
    raise LookupError(f"no counterexample for {cause.name} in {examples} image scenarios per mode")


def replay_mm(example: Any, handles: Any, wire_of: Callable[[list[list[bytes]]], list[dict[str, Any]]]) -> dict[str, Any]:
    """The example's first request once more through the real path, every step recorded;
    ``wire_of`` decodes the recorded ZMQ messages (the report's own decoder)."""
    from kvalign.model.hashing import U64_MASK
    from kvalign.oracles.router_path import RouterPath
    from kvalign.oracles.sglang import SglangRadixCache
    from kvalign.verify.props.mm.strategies import wire_parts

    systems, mm = handles
    frames: list[list[bytes]] = []

    def record(parts: list[bytes]) -> list[bytes]:
        frames.append(list(parts))
        return parts

    path = RouterPath(transform=record)
    try:
        p, eagle = example.page_size, example.eagle
        pre = mm.frontend.preprocess(p, wire_parts(example.first))
        eng = mm.sglang.process(pre.request)
        worker = path.worker(p, eagle)
        if not worker.barrier():
            raise RuntimeError(f"Dynamo {path.version}'s relay never indexed a plain sentinel page")
        start = len(frames)
        cache = SglangRadixCache(p, eagle=eagle)
        cache.insert(eng.padded)
        raw = cache.take_raw_events()
        worker.publisher.publish(raw)
        indexed_after = worker.barrier()
        wire = wire_of(frames[start:])
        stored = [h & U64_MASK for ev in raw if type(ev).__name__.startswith("BlockStored") for h in ev.block_hashes]
        dumped = {h: t for _p, h, t in worker.dump()}
        return {
            "page_size": p, "eagle": eagle,
            "frontend": {"token_ids": pre.token_ids, "routing_token_ids": pre.routing_token_ids,
                         "mm_hashes": pre.mm_hashes},
            "sglang": {"padded": eng.padded, "forwarded": eng.forwarded,
                       "items": [{"hash": it.hash, "pad_values": list(it.pad_values), "offsets": list(it.offsets)}
                                 for it in eng.items]},
            "wire": wire, "relay_alive_after": indexed_after,
            "indexed": [{"engine_hash": h, "router_local_hash": dumped.get(h)} for h in stored],
            "again": {"engine_pages": cache.match(eng.padded) // p,
                      "router_blocks": worker.overlap(pre.router_tokens, None, None)},
        }
    finally:
        path.close()


def close(handles: Any) -> None:
    from kvalign.verify.props.mm.body import close_mm_systems

    systems, mm = handles
    close_mm_systems(mm)
    systems.close()


def render_mm_replay(r: dict[str, Any]) -> list[str]:
    """The replay's sections of the Markdown report."""

    def _fence(text: str, lang: str = "") -> str:
        return f"```{lang}\n{text}\n```"

    fe, sg = r["frontend"], r["sglang"]
    out = ["The replay below runs the example's first request once more through the real path: Dynamo's frontend "
           "(`python -m dynamo.frontend`, chat request with the image as a data URL) → the worker request → SGLang's "
           "tokenizer manager and scheduler padding (QwenVLImageProcessor on CPU) → SGLang's `UnifiedRadixCache` → "
           "SGLang's `ZmqEventPublisher` → a 127.0.0.1 hop (recorded here) → Dynamo's `KvEventPublisher` relay → "
           f"`KvRouter`. Page size {r['page_size']}{', EAGLE' if r['eagle'] else ''}.", "",
           "## What Dynamo's frontend handed the router", "",
           f"- prompt token ids sent to the worker: {fe['token_ids']}",
           f"- routing sequence the router hashes: {fe['routing_token_ids']}",
           f"- image hashes forwarded to the worker (`extra_args.mm_hashes`): {fe['mm_hashes']}", "",
           "## What SGLang keyed", "",
           f"- padded token ids (the radix tree's key): {sg['padded']}",
           f"- frontend hashes SGLang used: {sg['forwarded']}", ""]
    out += ["| image | SGLang item hash | pad values | token offsets |", "|---|---|---|---|"]
    for i, it in enumerate(sg["items"], 1):
        out.append(f"| {i} | {it['hash'] if it['hash'] is None else hex(it['hash'])} | {it['pad_values']} | "
                   f"{it['offsets']} |")
    out += ["", "## Event bytes on the wire, as decoded", ""]
    for i, w in enumerate(r["wire"], 1):
        out += [f"Message {i} (topic {w['topic']!r}, seq {w['seq']}): frames (hex)", "",
                _fence("\n".join(w["frames_hex"])), "", "decoded (msgpack):", "",
                _fence(json.dumps(w["decoded"], ensure_ascii=False), "json"), ""]
    indexed = sum(b["router_local_hash"] is not None for b in r["indexed"])
    out += ["## What the router indexed", "",
            f"{indexed} of the {len(r['indexed'])} pages SGLang stored (the relay "
            f"{'kept indexing later sentinel pages' if r['relay_alive_after'] else 'stopped indexing'}).", "",
            "| engine block hash | router's local hash |", "|---|---|"]
    out += [f"| {b['engine_hash']} | {b['router_local_hash'] if b['router_local_hash'] is not None else 'not indexed'} |"
            for b in r["indexed"]]
    a = r["again"]
    out += ["", "## The same request again", "",
            f"SGLang's `match_prefix` reuses {a['engine_pages']} pages; the router credits {a['router_blocks']} blocks.",
            ""]
    return out
