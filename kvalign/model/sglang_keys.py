"""SGLang radix-cache page keys and event block hashes (sglang 0.5.19 / 0.5.23).

SGLang caches KV in pages of P *units*. A unit is a token in plain mode and a bigram
``(t_i, t_{i+1})`` when the server runs EAGLE-family speculative decoding, so in EAGLE mode page k
covers raw tokens ``[kP, kP+P]`` (P+1 tokens, one shared with the next page). The router can only
match what SGLang stores if it hashes exactly these raw windows; this module states them from the
engine's side so the two can be compared.

It also recomputes SGLang's own event ``block_hashes`` (a SHA-256 chain, signed int64), which
Dynamo treats as opaque node ids but which kvalign uses to link captured events back to pages.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

from kvalign.model.hashing import U32_MAX, TokenInput, as_u32_tokens

SALT_DOMAIN = b"sglang-cache-salt-v1\0"
NAMESPACE_DOMAIN = b"sglang-kv-event-namespace-v1"


def page_count(n_tokens: int, page_size: int, *, eagle: bool = False) -> int:
    """Full pages SGLang keeps for ``n_tokens`` raw tokens (``N-1`` bigram units under EAGLE)."""
    if page_size < 1:
        raise ValueError(f"page size must be >= 1, got {page_size}")
    units = max(n_tokens - 1, 0) if eagle else n_tokens
    return units // page_size


def matchable_pages(n_tokens: int, page_size: int, *, eagle: bool = False) -> int:
    """The most leading pages SGLang's scheduler matches of an ``n_tokens`` prompt (no logprobs asked).

    ``Req._compute_max_prefix_len`` (``managers/schedule_batch.py``) caps a match at ``input_len - 1``
    raw tokens, so the page holding the last token is computed again; under EAGLE those ``N - 1`` raw
    tokens key ``N - 2`` bigrams. For offline readers of a capture (``diagnose``), which run no
    scheduler; held equal to SGLang's own cap by tests/unit/model/test_sglang_keys_cap.py.
    """
    return page_count(max(n_tokens - 1, 0), page_size, eagle=eagle)


def page_windows(tokens: TokenInput, page_size: int, *, eagle: bool = False) -> list[tuple[int, ...]]:
    """Raw token window of every full page SGLang stores for ``tokens`` (P or P+1 tokens)."""
    toks = as_u32_tokens(tokens).tolist()
    win = page_size + 1 if eagle else page_size
    return [tuple(toks[k * page_size : k * page_size + win]) for k in range(page_count(len(toks), page_size, eagle=eagle))]


def page_units(tokens: TokenInput, page_size: int, *, eagle: bool = False) -> list[list[Any]]:
    """What a ``BlockStored.token_ids`` carries per page: P ints, or P ``(a, b)`` bigrams."""
    out = []
    for w in page_windows(tokens, page_size, eagle=eagle):
        out.append([(w[i], w[i + 1]) for i in range(page_size)] if eagle else list(w))
    return out


def is_bigram_payload(token_ids: Sequence[Any]) -> bool:
    """Whether an event's ``token_ids`` are bigram pairs (EAGLE) rather than flat ints.

    Dynamo decides EAGLE per event from this shape alone; an empty list counts as flat.
    """
    return bool(token_ids) and isinstance(token_ids[0], (list, tuple))


def raw_window(token_ids: Sequence[Any], *, strict: bool = True) -> list[int]:
    """Rebuild raw tokens from a payload: flat ints as-is; pairs -> all firsts + the last second.

    That is Dynamo's flattening. Pairs that do not chain (``b_i != a_{i+1}``) cannot come from
    one token sequence; ``strict`` rejects them (Dynamo does not check, and hashes what it gets).
    """
    if not is_bigram_payload(token_ids):
        return [int(t) for t in token_ids]
    if not strict:
        return [int(p[0]) for p in token_ids] + [int(token_ids[-1][1])]
    firsts = []
    for i, pair in enumerate(token_ids):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"bigram payload element {i} is not a pair: {pair!r}")
        if i and int(token_ids[i - 1][1]) != int(pair[0]):
            raise ValueError(f"bigram payload breaks its chain at element {i}: {token_ids[i - 1]!r} -> {pair!r}")
        firsts.append(int(pair[0]))
    return firsts + [int(token_ids[-1][1])]


def event_page_windows(token_ids: Sequence[Any], block_size: int, n_blocks: int) -> list[list[int]]:
    """Split a (possibly multi-page) ``BlockStored`` payload into per-page raw windows.

    SGLang coalesces one radix node's pages into one event: ``len(token_ids) == block_size *
    n_blocks``. Each page's window is rebuilt from its own units, so a bigram page gives P+1
    tokens exactly as Dynamo's relay computes it.
    """
    if block_size < 1:
        raise ValueError(f"event block_size must be >= 1, got {block_size}")
    return [raw_window(token_ids[i * block_size : (i + 1) * block_size]) for i in range(n_blocks)]


def _to_int64(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


def _page_bytes(units: Sequence[Any]) -> bytes:
    flat = [x for u in units for x in u] if is_bigram_payload(units) else list(units)
    if any(int(x) > U32_MAX for x in flat):
        # sglang 0.5.23's wide-token path: a 0xff tag, then u64-LE words.
        return b"\xff" + struct.pack(f"<{len(flat)}Q", *flat)
    return struct.pack(f"<{len(flat)}I", *flat)


def _ns_part(value: str | None) -> bytes:
    if value is None:
        return b"\0"
    raw = value.encode("utf-8")
    return b"\1" + len(raw).to_bytes(8, "little") + raw


def event_namespace(
    extra_key: str | None, cache_salt: str | None, *, lora_registered: bool, dynamo_format: bool
) -> tuple[str | None, str | None] | None:
    """The (extra_key, cache_salt) pair sglang 0.5.23 namespaces event hashes with, if any.

    Default format: only an ``extra_key`` that resolves to a registered LoRA name; ``format:
    "dynamo"``: both the extra key and the salt.
    """
    if dynamo_format:
        ns = (extra_key, cache_salt or None)
    else:
        ns = (extra_key if lora_registered else None, None)
    return None if ns == (None, None) else ns


def namespaced_hash(block_hash: int, namespace: tuple[str | None, str | None]) -> int:
    """Namespace one event hash by (extra_key, cache_salt), as sglang 0.5.23 does."""
    extra_key, cache_salt = namespace
    seed = hashlib.sha256(NAMESPACE_DOMAIN + _ns_part(extra_key) + _ns_part(cache_salt)).digest()
    return _to_int64(hashlib.sha256(seed + block_hash.to_bytes(8, "big", signed=True)).digest())


def engine_block_hashes(
    tokens: TokenInput,
    page_size: int,
    *,
    eagle: bool = False,
    cache_salt: str | None = None,
    namespace: tuple[str | None, str | None] | None = None,
) -> list[int]:
    """SGLang's event ``block_hashes`` for the pages of ``tokens`` (signed int64 each).

    Chain: ``d_k = sha256(d_{k-1} || page_bytes)``, started from ``sha256(domain || salt)`` when a
    ``cache_salt`` is set; the hash is the first 8 digest bytes, big-endian, signed. Each value is
    then namespaced when ``namespace`` is given (see :func:`event_namespace`).
    """
    prev = hashlib.sha256(SALT_DOMAIN + cache_salt.encode("utf-8")).digest() if cache_salt else b""
    out = []
    for units in page_units(tokens, page_size, eagle=eagle):
        prev = hashlib.sha256(prev + _page_bytes(units)).digest()
        h = _to_int64(prev)
        out.append(namespaced_hash(h, namespace) if namespace else h)
    return out
