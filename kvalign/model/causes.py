"""The catalog of named causes of router/engine key divergence, and a hasher-level classifier.

Every real cache-blind regression so far was one of a handful of flag or framing mismatches
(Dynamo #5096, #10982, #11764, #14530). Naming the cause — not just "hashes differ" — is what
turns a failed check into a fix, so findings are labelled from this one catalog everywhere
(``check``, ``diagnose``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any

from kvalign.model.hashing import block_hashes, salt_seed


class Cause(str, Enum):
    """Why the router's block keys stopped matching the engine's."""

    ROUTER_EAGLE_OFF = "router eagle off vs engine bigram keys"
    ROUTER_EAGLE_ON = "router eagle on vs engine plain keys"
    EAGLE_B_WINDOW = "eagle mode hashes B-token windows instead of B+1"
    EAGLE_BLOCK_COUNT = "eagle block count rule differs (must be floor((N-1)/B))"
    BLOCK_SIZE = "block size mismatch"
    LORA_DROPPED = "LoRA name dropped from the hash seed"
    NAMESPACE_DROPPED = "cache namespace (cache_salt) dropped from the hash seed"
    SEED_DRIFT = "LoRA / namespace / cache_salt seed drift"
    MM_DROPPED = "multimodal mm_hash bytes dropped"
    PROMPT_SHIFT = "prompt shifted by k tokens (template or BOS drift)"
    EVICTED = "blocks evicted (BlockRemoved)"
    SEQUENCE_GAP = "sequence gap / dropped batch"
    PROMPT_TOO_SHORT = "prompt shorter than one block (eagle needs B+1 tokens)"
    CARD_EAGLE_OFF = "card enable_eagle off for an algorithm SGLang keys by bigrams"
    CARD_EAGLE_ON = "card enable_eagle on for an algorithm SGLang keys by plain tokens"
    CARD_UNAVAILABLE = "dynamo.sglang registration code does not run with this SGLang"
    EVENTS_DROPPED = "router ingestion dropped engine events"
    TENANTS_SHARE_KEYS = "router ingestion ignores cache_salt: tenants share keys"
    INGEST_STALE = "router index kept blocks the engine removed or cleared"
    LORA_NOT_IN_EVENTS = "SGLang's events carry no LoRA name: the router keys adapter pages as base-model pages"
    SALT_NOT_IN_EVENTS = ("SGLang's events carry no cache_salt (it keys the tenant apart, then publishes its pages as "
                          "unsalted ones): the router keys salted pages as unsalted pages")
    PATH_UNAVAILABLE = "the release's worker relay / router cannot run here"
    TIER_MISFILED = "router files a page under another tier than the one SGLang's event names (device vs host)"
    TIER_RESIDENCY = "router's device / host credit differs from SGLang's HiCache residency"
    MEDIUM_NOT_INDEXED = "the relay maps no tier to the event's medium: those pages are indexed nowhere, silently"
    HOST_CREDIT_NOT_SERVABLE = ("router credits host-tier pages that SGLang will not load back (host-only stretch "
                                "below its load_back_threshold): the engine re-prefills them")
    LAST_PAGE_CAPPED = ("router credits the page holding the prompt's last token, which SGLang's scheduler never "
                        "matches (it caps a match at input_len - 1 tokens): the engine computes that page again")
    REGISTERED_BLOCK_SIZE = ("Dynamo registers a block size other than the one SGLang's KV events carry (a page size "
                             "SGLang set after Dynamo read it): the relay drops every page, the router's hit rate is 0")
    ADVERTISED_BLOCK_SIZE = "SGLang's /server_info advertises a KV-event block_size its events do not carry"
    TENANT_HASH_COLLISION = ("SGLang publishes one block hash for two tenants' pages (LoRA / cache_salt): the router "
                             "keeps one entry for both, and removing either removes both")
    PARENT_OUTSIDE_NAMESPACE = "a page's parent hash is another tenant's page: the router attaches it below the wrong tenant"
    LORA_NAME_MISMATCH = "SGLang publishes a LoRA page under another name than the one the request carries"
    DP_RANK_UNPUBLISHED = ("a data-parallel rank's scheduler publishes no KV events (only rank 0 publishes): the "
                           "router never indexes that rank's cache")
    DP_RANK_TAG = ("a data-parallel rank's batches carry another rank's attn_dp_rank: Dynamo drops them as disagreeing "
                   "with their source, so that rank's cache is never indexed")
    DP_RANK_UNSUBSCRIBED = ("a data-parallel rank is registered for routing but its KV events are never subscribed: the "
                            "router routes to a rank it never indexed")
    DP_RANK_UNREGISTERED = ("SGLang runs a data-parallel rank that the worker's card does not register: the router never "
                            "routes to it")
    DP_RANK_MISATTRIBUTED = "a block stored by one data-parallel rank is credited to another rank"
    DP_ROUTED_ELSEWHERE = ("the router sends the request to another data-parallel rank than the one its overlap scored "
                           "(or with another rank's credit)")
    ENGINE_EVENTS_MISSING = ("the engine reused pages its own KV events never stored in the prompt's chain (never "
                             "stored, stored under a wrong parent or block hash, or removed): SGLang's publisher, no "
                             "router can credit them")
    ENGINE_EVENTS_LATE = ("the engine's KV events stored pages it reused, or removed pages it had freed, only after "
                          "the request was routed: a timing race shown by the recorded stream, not a key mismatch")
    ENGINE_REMOVALS_MISSING = ("the engine freed pages its own KV events still hold (no BlockRemoved or clear ever "
                               "followed): SGLang's publisher, so the router credits pages no worker can reuse")
    REPLICA_INDEX_DIVERGED = "router replicas would route the same prompt by indexes that hold different pages"
    REPLICA_STATE_UNSYNCED = ("a router replica misses its peers' active-sequence events (no replica sync): its "
                              "load view lacks their in-flight requests")
    # vLLM behind Dynamo's relay (kvalign.verify.props.vllm): what vLLM publishes that the relay cannot key.
    VLLM_BYTES_HASHES_DROPPED = ("vLLM publishes its block hashes as bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): "
                                 "Dynamo's relay drops every such event, silently, and the router indexes none of "
                                 "vLLM's blocks")
    VLLM_SALT_UNPREFIXED = ("a cache_salt reaches vLLM without Dynamo's dynamo-cache-salt: prefix: vLLM keys the "
                            "tenant apart, the relay keys its blocks as unsalted ones and credits unsalted requests "
                            "with blocks vLLM will not reuse for them")
    VLLM_BLOCK_COPIES_UNCOUNTED = ("the router keeps one entry per block hash and drops it at the first BlockRemoved "
                                   "of that hash while vLLM still holds another copy (a hybrid model's full-attention "
                                   "group computes a prefix again where its sliding window missed, and a relay that "
                                   "reads no group tags takes the window's copies for full attention's): the router "
                                   "credits none of the blocks vLLM reuses from that block on")
    VLLM_RESET_PUBLISHED_LATE = ("vLLM publishes a prefix-cache reset (AllBlocksCleared) only after its next model "
                                 "step: until an idle worker's next request runs, the router credits it every block "
                                 "it cleared")
    # Multimodal prompts (kvalign.verify.props.mm.body): how an image's pages stop matching.
    MM_PAD_WIDTH = ("SGLang keys an image's tokens by pad values wider than the router's u32 token ids: Dynamo's "
                    "relay drops every event batch holding one, and the frontend's u32 pad values cannot match them")
    MM_PAD_VALUES = "the frontend fills an image's tokens with other pad values than SGLang does for the same image hash"
    MM_HASH_NOT_FORWARDED = ("the worker did not pass the frontend's image hash to SGLang, which hashed the pixels "
                             "itself: its pad values differ from the router's")
    MM_ROUTING_SKIPPED = ("the frontend built no multimodal routing sequence: the router hashed the prompt with one "
                          "placeholder per image, SGLang keyed the expanded image")
    MM_PLACEHOLDER_COUNT = "the frontend expands an image to another number of placeholder tokens than SGLang's processor"
    MM_EAGLE_WINDOW = ("EAGLE: the router's B+1-token window of the page ending where an image starts differs from "
                       "SGLang's bigram page, which reaches one token into the image")
    MM_IMAGE_REUSED = "a changed image was credited: its pad values did not change with its pixels"
    SWA_STATE_NOT_REUSABLE = ("router credits full-attention blocks whose sliding-window KV SGLang no longer holds "
                              "(freed behind the window while the request ran, or evicted, with no removal published): "
                              "SGLang reuses the prefix only up to where the window survives")
    MAMBA_STATE_NOT_REUSABLE = ("router credits full-attention blocks past the last Mamba state SGLang holds on the "
                                "prompt's path: SGLang keeps a Mamba state only at the end of a cached node, so a "
                                "prefix ending inside one has none (no event says so), and it evicts states "
                                "without a removal")
    STORAGE_TIER_UNCREDITED = "SGLang holds pages in its storage tier (L3) that the router credits in no tier"
    DISK_CREDIT_WEIGHTED = ("the router credits a page in the engine's storage tier at its disk_cache_hit_weight "
                            "(--router-disk-cache-hit-weight, 0.25 of a device block by default) while SGLang loads "
                            "it back whole: with the page's events published, the router still prefers a candidate "
                            "holding fewer pages on device")
    STORAGE_KEY_MISMATCH = "SGLang's storage backend wrote pages under other keys than SGLang's own storage key function"
    TENANT_STORAGE_REUSE = ("a second tenant (cache_salt / LoRA) reused the first tenant's pages from a tier: a "
                            "cross-tenant leak")
    # The decode half of prefill/decode disaggregation (kvalign.live.runs.disagg_invisible): what the
    # prefill->decode hand-off lost, named from the transfer's own surfaces and an aggregated run.
    KV_NOT_TRANSFERRED = ("decode ran the request without the prompt's KV: the prefill->decode transfer moved no "
                          "byte (SGLang's fake backend, or a transfer that never ran)")
    KV_CHECKSUM_MISMATCH = ("the KV pages decode received are not the ones prefill sent (SGLang's KV checksum "
                            "failed): decode aborted the request")
    DRAFT_STATE_NOT_TRANSFERRED = ("decode's EAGLE draft accepted fewer draft tokens than one aggregated worker's on "
                                   "the same output: the draft's own state did not arrive intact")
    DECODE_OUTPUT_DIVERGED = ("decode's output differs from one aggregated worker's on the same prompt although the "
                              "KV arrived and was verified: the hand-off's other state (first token, EAGLE hidden "
                              "states) or decode itself differs")
    UNKNOWN = "unclassified hash difference"


#: What a finding of each cause does to routing (``check``'s exit status, the advisories, the matrix and the
#: reports read it from here). ``cache-blind``: the router's keys, card or events disagree with the engine's,
#: so credit is lost or invented without bound; ``credit-skew``: the keys agree, and an engine rule or a
#: router weight makes the credit differ by an amount the installed packages' constants bound
#: (:mod:`kvalign.verify.engine.impact` computes it); ``scoped``: counted apart from the mismatches, never failing a row.
CACHE_BLIND, CREDIT_SKEW, SCOPED = "cache-blind", "credit-skew", "scoped"
CLASSES = (CACHE_BLIND, CREDIT_SKEW, SCOPED)
#: Bounded by a documented constant: SGLang's load_back_threshold and the router's host weight; the router's
#: disk weight (a router setting: at most the pages in storage x (1 - weight) blocks of credit per request);
#: vLLM's reset published with its next step (per reset, the requests routed to the worker before that step's
#: events arrive, each credited at most the blocks it cleared: measured, one request when they come one at a time).
_CREDIT_SKEW = frozenset({Cause.HOST_CREDIT_NOT_SERVABLE, Cause.DISK_CREDIT_WEIGHTED, Cause.VLLM_RESET_PUBLISHED_LATE})
#: Causes counted apart: the page past the scheduler's cap (one block per request, every release), the
#: engine's events arriving after the routing decision (a timing race, not a key).
_SCOPED = frozenset({Cause.LAST_PAGE_CAPPED, Cause.ENGINE_EVENTS_LATE})


def cause_class(cause: Cause | str) -> str:
    """The class of a cause (its member or its name): anything not known to be bounded is cache-blind, so
    a new cause fails ``check`` until someone shows its bound."""
    c = cause if isinstance(cause, Cause) else Cause[cause]
    return CREDIT_SKEW if c in _CREDIT_SKEW else SCOPED if c in _SCOPED else CACHE_BLIND


def _window_b_eagle_count(tokens: Sequence[int], b: int, **kw: Any) -> list[int]:
    """What a router that kept the eagle block count but hashed B-token windows would give."""
    n = max(len(tokens) - 1, 0) // b
    return block_hashes(list(tokens)[: n * b], b, **kw)


def classify_hash_mismatch(
    got: Sequence[int],
    tokens: Sequence[int],
    block_size: int,
    *,
    eagle: bool,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
    mm_infos: Sequence[Mapping[str, Any] | None] | None = None,
) -> Cause:
    """Name the misalignment that explains a router's hashes ``got`` for this input.

    Each catalog hypothesis is replayed with kvalign's exact reference; the first one that
    reproduces ``got`` exactly is the cause.
    """
    got = list(got)
    kw = dict(lora_name=lora_name, cache_namespace=cache_namespace, mm_infos=mm_infos)
    candidates: list[tuple[Cause, Callable[[], list[int]]]] = []
    if eagle:
        candidates.append((Cause.ROUTER_EAGLE_OFF, lambda: block_hashes(tokens, block_size, eagle=False, **kw)))
        candidates.append((Cause.EAGLE_B_WINDOW, lambda: _window_b_eagle_count(tokens, block_size, **kw)))
    else:
        candidates.append((Cause.ROUTER_EAGLE_ON, lambda: block_hashes(tokens, block_size, eagle=True, **kw)))
    if lora_name:
        candidates.append((Cause.LORA_DROPPED, lambda: block_hashes(tokens, block_size, eagle=eagle, **{**kw, "lora_name": None})))
    if cache_namespace:
        candidates.append(
            (Cause.NAMESPACE_DROPPED, lambda: block_hashes(tokens, block_size, eagle=eagle, **{**kw, "cache_namespace": None}))
        )
    if lora_name and cache_namespace:
        candidates.append(
            (Cause.SEED_DRIFT, lambda: block_hashes(tokens, block_size, eagle=eagle, mm_infos=mm_infos))
        )
    if mm_infos:
        candidates.append((Cause.MM_DROPPED, lambda: block_hashes(tokens, block_size, eagle=eagle, **{**kw, "mm_infos": None})))
    for cause, replay in candidates:
        if replay() == got:
            return cause
    expected_n = len(block_hashes(tokens, block_size, eagle=eagle, **kw))
    if eagle and len(got) != expected_n:
        return Cause.EAGLE_BLOCK_COUNT
    if (lora_name or cache_namespace) and salt_seed(lora_name, cache_namespace) != salt_seed():
        ref = block_hashes(tokens, block_size, eagle=eagle, **kw)
        if len(ref) == len(got):
            return Cause.SEED_DRIFT
    return Cause.UNKNOWN
