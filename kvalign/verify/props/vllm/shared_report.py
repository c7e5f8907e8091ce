"""What ``kvalign report CAUSE --engine vllm`` says of the vLLM findings that carry an SGLang cause's name.

Three findings of the vLLM properties share their cause with an SGLang finding (the same disagreement on the other
engine): ``SWA_STATE_NOT_REUSABLE`` (the router credits hybrid blocks whose sliding window vLLM evicted),
``HOST_CREDIT_NOT_SERVABLE`` (vllm#57159: the offload connector's chunks) and ``MM_IMAGE_REUSED`` (an image
identifier not in Dynamo's marked form). Their SGLang reports stay ``kvalign report``'s default; this module collects
the vLLM ones as :mod:`kvalign.verify.props.vllm.report` collects the ``VLLM_*`` findings: the finding replayed once
on vLLM's real ``KVCacheManager`` behind Dynamo's real relay and ``KvRouter`` (the tests' steps), its routing impact
on the real two-rank router (the tests' measurements: :mod:`~kvalign.verify.props.vllm.hybrid_impact`,
:mod:`~kvalign.verify.props.vllm.tiers_impact`, :mod:`~kvalign.verify.props.vllm.mm_impact`), who meets it in a
``dynamo.vllm`` deployment (read from Dynamo's own paths), and the source lines in the pinned releases.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvalign.model.causes import CREDIT_SKEW, Cause, cause_class
from kvalign.verify.props.vllm.report import Anchor, _plain, _roots, locate

BLOCK_SIZE = 16
#: the offload connector's chunk in blocks, as the finding's test and impact configure it
CHUNK = 4


@dataclass(frozen=True)
class SharedFinding:
    """One finding's fixed words: what goes wrong on vLLM (the cause's own text is SGLang's), what shows it, who
    meets it, the upstream threads that apply (None: none known), and the source lines it comes from."""

    title: str
    found_by: str
    reach: str
    upstream: str | None
    anchors: tuple[Anchor, ...]


FINDINGS: dict[Cause, SharedFinding] = {
    Cause.SWA_STATE_NOT_REUSABLE: SharedFinding(
        "the router credits full-attention blocks of a hybrid model whose sliding-window blocks vLLM evicted "
        "(their removal names the window group, which the relay skips): vLLM reuses none of the prefix",
        "tests/unit/verify/props/vllm/test_vllm_hybrid.py (`test_finding_the_router_credits_blocks_whose_window_vllm_"
        "evicted`) and the replay below; the `hybrid` row of `check --engine vllm` does not fail on it (it guards "
        "that the router's index is vLLM's full-attention group, as Dynamo designs it)",
        "any `dynamo.vllm` worker serving a hybrid model with sliding-window layers and prefix caching on, with KV "
        "events published (`--kv-events-config`): the relay `dynamo.vllm` starts keeps the main-attention groups' "
        "events only, so no window eviction reaches the router, and nothing says so",
        None,
        (Anchor("vllm", "v1/core/single_type_kv_cache_manager.py",
                "sliding_window_contiguous_blocks = cls._contiguous_blocks_for_hit(",
                "vLLM's sliding-window group hits only where the window before the hit's end is cached: a prefix "
                "whose window blocks were evicted is a miss, whatever the full-attention group holds"),
         Anchor("vllm", "v1/core/kv_cache_manager.py", "event.kv_cache_spec_kind = kind",
                "vLLM tags each event with its group's kind, so a window group's BlockRemoved is told apart"),
         Anchor("dynamo", "vllm/cache_info.py", 'if group.get("kind") in MAIN_ATTENTION_KV_CACHE_KINDS:',
                "dynamo.vllm sizes its relay by the main-attention group; the relay (compiled Rust in dynamo._core) "
                "keeps those groups' events and skips the sliding-window group's, its removals included (the "
                "replay above)"))),
    Cause.HOST_CREDIT_NOT_SERVABLE: SharedFinding(
        "vllm#57159: vLLM's offload connector publishes every block of a chunk it stored in its CPU tier, and loads "
        "chunks only whole: the router credits host blocks of a partial chunk that vLLM recomputes",
        "tests/unit/verify/props/vllm/test_tiers_chunks.py (`test_finding_the_connector_advertises_blocks_of_chunks_"
        "it_loads_only_whole`, `test_finding_less_than_a_chunk_past_the_device_hit_is_credited_and_not_loaded`) "
        "and the replay below; the `tiers` row of `check --engine vllm` runs one block a chunk, where it cannot "
        "show",
        "any `dynamo.vllm` worker with vLLM's CPU offload connector (`OffloadingConnector`) configured with a chunk "
        "of more than one block (its `block_size` a multiple of vLLM's) and KV events published: `dynamo.vllm` "
        "relays the connector's `medium` `CPU` stores as host-tier blocks",
        "vllm-project/vllm#57159 (this finding upstream: an offload connector advertising per-block hashes for "
        "chunks it can only return whole)",
        (Anchor("vllm", "distributed/kv_transfer/kv_connector/v1/offloading/events.py",
                "maybe_convert_block_hash(h) for h in meta.block_hashes",
                "the connector's BlockStored names every block hash of the stored chunk"),
         Anchor("vllm", "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
                "if max_hit_size_tokens - num_computed_tokens < tokens_per_chunk:",
                "_lookup_complete_chunks loads nothing when less than a chunk is left past the device hit"),
         Anchor("vllm", "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
                "start_chunk_idx = num_computed_tokens // tokens_per_chunk",
                "it looks chunks up whole (each by its key: the chunk's last block), from the chunk holding the "
                "device hit, so the blocks of a chunk the prompt covers only in part are never loaded"))),
    Cause.MM_IMAGE_REUSED: SharedFinding(
        "an image identifier not in Dynamo's marked form reaches vLLM: vLLM keys the image by it, the relay keys "
        "the image's blocks by their placeholder tokens only, and the router credits a prompt with another image "
        "blocks vLLM will not reuse",
        "tests/unit/verify/props/vllm/test_vllm_mm.py (`test_finding_an_unmarked_image_identifier_is_keyed_by_tokens_"
        "only`) and the replay below; the `mm` row of `check --engine vllm` hands vLLM each image as `dynamo.vllm` "
        "does with the frontend's hashes, marked",
        "any `dynamo.vllm` deployment taking image requests on a path where the vLLM frontend forwards no image "
        "hashes: a request carrying `multi_modal_uuids` (the frontend then routes by text prefix, and the worker "
        "hands vLLM the client's identifiers as they are), or one with `mm_processor_kwargs` (exact image routing "
        "off; the worker hands vLLM the blake3 digests it computes of the pixels, logging only that they \"may not "
        "match routing decisions\"); with the frontend's exact image routing on and no client identifiers, the "
        "worker marks the frontend's hashes and the router keys images apart",
        None,
        (Anchor("vllm", "v1/core/kv_cache_utils.py", 'extra_keys.append(("mm", mm_feature.identifier',
                "vLLM keys an image's blocks by the identifier it was handed, whatever its form"),
         Anchor("dynamo", "vllm/multimodal_utils/request_processor.py", 'marked_hashes.append(prefix + "0" * 48)',
                "dynamo.vllm marks the frontend's forwarded hashes (16 hex digits, 48 zeros): the only form the relay "
                "reads back as an image"),
         Anchor("dynamo", "vllm/multimodal_utils/request_processor.py", "mm_uuids = _build_user_mm_uuids(",
                "the worker hands vLLM a request's own multi_modal_uuids first, unmarked"),
         Anchor("dynamo", "vllm/multimodal_utils/request_processor.py", "mm_uuids = compute_mm_uuids(multi_modal_data)",
                "with no forwarded hashes, the worker hands vLLM blake3 hex digests of the pixels, unmarked"),
         Anchor("dynamo", "frontend/vllm_processor.py", 'if dynamo_preproc.get("multi_modal_uuids"):',
                "the vLLM frontend routes a request with client identifiers by text prefix and forwards no hashes"),
         Anchor("dynamo", "frontend/vllm_processor.py", "Exact MM routing disabled because",
                "with mm_processor_kwargs it routes by text prefix and forwards no hashes either"))),
}
SHARED = frozenset(FINDINGS)


def _served_tokens(b: int, n: int, base: int, tail: int = 1) -> list[int]:
    return [base + i for i in range(n * b)] + [base + 999] * tail


def replay_hybrid(path: Any) -> dict[str, Any]:
    """The test's steps on one hybrid vLLM worker (window two blocks): a 5-block prompt served twice, a 2-block
    prompt evicting window blocks only; then each prefix of the first prompt against the router's credit."""
    from kvalign.oracles.vllm_router import vllm_worker
    from kvalign.verify.props.vllm.hybrid import NUM_BLOCKS

    b, base = BLOCK_SIZE, 1 << 23
    worker = vllm_worker(path, b, NUM_BLOCKS, sliding_window=2 * b)
    try:
        first = _served_tokens(b, 5, base)
        events = []
        for tokens in (first, first, [base + 500 + i for i in range(2 * b)] + [base + 998]):
            worker.engine.prefill(tokens)
            events += worker.sync()
        queries = [(f"the first prompt's first {n} block(s) and a token", first[: n * b] + [base + 997])
                   for n in range(1, 5)] + [("the first prompt again", first)]
        return {"block_size": b, "indexed": _indexed(worker), "events": [_plain(e) for e in events],
                "served": (f"vLLM (block size {b}, a full-attention group and a sliding-window group of window "
                           f"{2 * b} tokens in one pool of {NUM_BLOCKS} blocks) served a {len(first)}-token prompt "
                           f"twice, then a {2 * b + 1}-token prompt whose allocation evicted window blocks only (a "
                           "BlockRemoved of group 1, which the relay skips); its events reached Dynamo's relay as vLLM published "
                           "them"),
                "requests": [{"request": name, "vllm_reuses": worker.engine.match(q),
                              "router_blocks": worker.overlap(q)} for name, q in queries]}
    finally:
        worker.close()


def replay_chunks(path: Any) -> dict[str, Any]:
    """The test's steps on one vLLM worker with a CPU tier of :data:`CHUNK`-block chunks: a 4-block prompt stored,
    evicted from the device by two others; then a prompt sharing 3 of its 4 blocks."""
    from kvalign.oracles.vllm_router import vllm_worker
    from kvalign.verify.props.vllm.strategies import Served
    from kvalign.verify.props.vllm.tiers import credit

    b, base = BLOCK_SIZE, 1 << 23
    worker = vllm_worker(path, b, 10, offload={"blocks_per_chunk": CHUNK, "num_chunks": 8})
    try:
        first = Served((0, 1, 2, 0), 1).tokens(base, b)
        events = []
        for chunks in ((0, 1, 2, 0), (1, 1, 1, 1), (2, 2, 2, 2)):
            worker.engine.prefill(Served(chunks, 1).tokens(base, b))
            events += worker.sync()
        rows = []
        for name, q in ((f"the first prompt's first {CHUNK - 1} blocks and a token", first[: (CHUNK - 1) * b]
                         + [base + 998]), ("the first prompt again", first)):
            c = credit(worker, q)
            rows.append({"request": name, "vllm_reuses": worker.engine.match(q),
                         "router_blocks": f"{c.device} device + {c.host} host"})
        return {"block_size": b, "indexed": _indexed(worker), "events": [_plain(e) for e in events],
                "served": (f"vLLM (block size {b}, 10 device blocks, a CPU tier of 8 chunks of {CHUNK} blocks) served "
                           f"a {len(first)}-token prompt, then two others that evicted its blocks from the device (the "
                           "CPU tier keeps its chunk); its events and the connector's reached Dynamo's relay as "
                           "published"),
                "requests": rows}
    finally:
        worker.close()


def replay_mm(path: Any) -> dict[str, Any]:
    """The test's steps: a prompt served with one unmarked image identifier, queried with another as the frontend
    queries when it routes by text prefix (no image hashes)."""
    from kvalign.oracles.vllm_router import vllm_worker
    from kvalign.verify.props.vllm.mm_impact import NUM_BLOCKS, QUERY_IMAGE, SERVED_IMAGE, image_prompt

    b, base = BLOCK_SIZE, 1 << 23
    worker = vllm_worker(path, b, NUM_BLOCKS)
    try:
        tokens, offset, length = image_prompt(base, b)
        worker.engine.prefill(tokens, mm=[(SERVED_IMAGE, offset, length)])
        events = worker.sync()
        return {"block_size": b, "indexed": _indexed(worker), "events": [_plain(e) for e in events],
                "served": (f"vLLM (block size {b}) served a {len(tokens)}-token prompt with one image (placeholders "
                           f"{offset}..{offset + length - 1}, identifier {SERVED_IMAGE[:8]}…: 64 hex digits, the "
                           "form vLLM and dynamo.vllm compute, not Dynamo's marked one); its events reached Dynamo's "
                           "relay as vLLM published them; the router is queried by text prefix, as the frontend "
                           "routes such a request"),
                "requests": [{"request": f"the same tokens, image {image[:8]}…", "vllm_reuses":
                              worker.engine.match(tokens, mm=[(image, offset, length)]),
                              "router_blocks": worker.overlap(tokens)}
                             for image in (SERVED_IMAGE, QUERY_IMAGE)]}
    finally:
        worker.close()


def _indexed(worker: Any) -> list[dict[str, Any]]:
    return [{"parent": p, "engine_hash": h, "router_local_hash": loc} for p, h, loc in worker.dump()]


#: per finding: its replay, its routing measurement, and what the other candidate holds in it
REPLAYS: dict[Cause, Callable[[Any], dict[str, Any]]] = {
    Cause.SWA_STATE_NOT_REUSABLE: replay_hybrid, Cause.HOST_CREDIT_NOT_SERVABLE: replay_chunks,
    Cause.MM_IMAGE_REUSED: replay_mm}
OTHER_HOLDS = {
    Cause.SWA_STATE_NOT_REUSABLE: "a fresh hybrid vLLM engine holding the query's first k blocks intact (window "
                                  "included)",
    Cause.HOST_CREDIT_NOT_SERVABLE: "a plain vLLM engine holding the query's first k blocks on device",
    Cause.MM_IMAGE_REUSED: "a vLLM engine holding the query's first k blocks, served with the query's own image",
}


def _measure(cause: Cause, path: Any) -> Any:
    if cause is Cause.SWA_STATE_NOT_REUSABLE:
        from kvalign.verify.props.vllm.hybrid_impact import measure_hybrid_routing

        return measure_hybrid_routing(path, BLOCK_SIZE)
    if cause is Cause.HOST_CREDIT_NOT_SERVABLE:
        from kvalign.verify.props.vllm.tiers_impact import measure_chunk_routing

        return measure_chunk_routing(path, BLOCK_SIZE)
    from kvalign.verify.props.vllm.mm_impact import measure_mm_routing

    return measure_mm_routing(path, BLOCK_SIZE)


def chunk_bound(host_weight: float) -> str:
    """The credit skew's bound: what the router may credit of a chunk the connector does not load, per request."""
    n = CHUNK - 1
    return (f"at most {n} host blocks per request with {CHUNK} blocks a chunk (blocks_per_chunk - 1: vLLM's connector "
            "loads every whole chunk of the host-resident prefix, from the chunk holding the device hit, and nothing "
            f"of a chunk the prompt covers only in part) x host weight {host_weight:g} = {n * host_weight:g} blocks "
            "of credit")


def routing(cause: Cause, impact: Any) -> dict[str, Any]:
    """The measured trials as the report's table takes them: per k, the router's credit on each candidate (the
    pair settled on it before routing) and each engine's reuse."""
    state = (f"the first: {impact.what or 'a hybrid vLLM engine'} after the finding's steps, credited "
             f"{impact.credited} block(s) of the query and reusing {impact.reusable}; the other: {OTHER_HOLDS[cause]}")
    return {"state": state, "trials": [{**t.as_dict(), "credited": [impact.credited, t.k]} for t in impact.trials]}


def collect(cause: Cause) -> dict[str, Any]:
    """Everything the vLLM report of ``cause`` (one of :data:`SHARED`) says, measured here."""
    from kvalign.oracles.router_path import RouterPath
    from kvalign.releases.vllm_env import VLLM_DIST, VLLM_VERSION

    if cause not in FINDINGS:
        raise ValueError(f"{cause.name} has no vLLM report (one of {sorted(c.name for c in FINDINGS)})")
    f = FINDINGS[cause]
    with RouterPath() as path:
        evidence = REPLAYS[cause](path)
        impact = _measure(cause, path)
        weight = path.host_weight if cause_class(cause) == CREDIT_SKEW else None
    roots = _roots()
    data = {"cause": cause.name, "cause_text": f.title, "class": cause_class(cause), "found_by": f.found_by,
            "reach": f.reach, "upstream": f.upstream,
            "versions": {"ai-dynamo": importlib.metadata.version("ai-dynamo"),
                         "ai-dynamo-runtime": importlib.metadata.version("ai-dynamo-runtime"),
                         "vllm_dist": VLLM_DIST, "vllm": VLLM_VERSION},
            "replay": evidence, "impact": impact.says(), "changes_worker": impact.changes_worker,
            "routing": {"counterexample": routing(cause, impact)},
            "anchors": [locate(a, roots) for a in f.anchors]}
    return {**data, "bound": chunk_bound(weight)} if weight is not None else data
