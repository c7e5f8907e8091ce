"""Dynamo KV-router block hashing, reimplemented exactly (ai-dynamo-runtime 1.6.1).

The router decides which worker already holds a prompt's KV by hashing the prompt into blocks
and walking those *local* hashes down a radix tree rebuilt from worker events. If kvalign's
hashes differ from the router's by one bit, every prediction kvalign makes is worthless, so this
module mirrors ``dynamo._core.compute_block_hash_for_seq`` rule for rule:

* local hash = XXH3-64 of the block's tokens as u32 little-endian (+ the block's sorted
  multimodal ``mm_hash`` values as u64 little-endian), seeded with
  ``1337 + xxh3(lora, 0) + xxh3(namespace, 1)`` (mod 2^64; ``None`` and ``""`` mean absent);
* plain mode: window B, stride B, ``N // B`` blocks; EAGLE mode: window **B+1**, stride B,
  ``max(N-1, 0) // B`` blocks, because SGLang keys EAGLE pages by bigrams and a page of B
  bigrams spans B+1 raw tokens; partial tails are dropped;
* sequence hash chain: ``seq[0] = local[0]``, ``seq[i] = xxh3(u64le(seq[i-1]) || u64le(local[i]), 1337)``.

Speed matters because a router hashes every prompt, mostly short ones, from a Python list:

* the list is packed once into a little-endian u32 buffer with ``array.fromlist`` — one C loop
  that also range-checks, and about a third cheaper than ``array('I', list)``, which fetches each
  item through the generic sequence protocol;
* one numpy view with item type ``V<window bytes>`` and stride ``4·B`` lays every block window over
  that buffer without copying — in EAGLE mode the items overlap by one token, which a view with a
  stride smaller than its item size expresses directly — and ``.tolist()`` turns the windows into
  ``bytes`` objects in one C loop;
* then it is one ``xxh3_64_intdigest`` call per block through ``map`` (no per-token Python work,
  no Python-level loop).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from functools import lru_cache
from itertools import repeat
from typing import Any

import numpy as np
import xxhash

XXH3_SEED = 1337
U32_MAX = 0xFFFFFFFF
U64_MASK = 0xFFFFFFFFFFFFFFFF

_xxh3 = xxhash.xxh3_64_intdigest
_pair = struct.Struct("<QQ")
_BIG_ENDIAN = sys.byteorder == "big"
assert array("I").itemsize == 4, "array('I') must be 32-bit on this platform"

TokenInput = Sequence[int] | np.ndarray
MmInfos = Sequence[Mapping[str, Any] | None]


@lru_cache(maxsize=1024)
def salt_seed(lora_name: str | None = None, cache_namespace: str | None = None) -> int:
    """The XXH3 seed the router derives from a LoRA name and a cache namespace (cache_salt).

    LoRA and namespace isolate tenants *only* through this seed: no extra bytes are hashed.
    """
    seed = XXH3_SEED
    if lora_name:
        seed = (seed + _xxh3(lora_name.encode("utf-8"), 0)) & U64_MASK
    if cache_namespace:
        seed = (seed + _xxh3(cache_namespace.encode("utf-8"), 1)) & U64_MASK
    return seed


def block_count(n_tokens: int, block_size: int, *, eagle: bool = False) -> int:
    """How many complete blocks the router hashes for ``n_tokens`` tokens."""
    _check_block_size(block_size)
    return max(n_tokens - 1, 0) // block_size if eagle else n_tokens // block_size


def as_u32_tokens(tokens: TokenInput) -> array | np.ndarray:
    """Validate token ids and return them as a contiguous little-endian u32 buffer.

    Lists go through ``array('I', ...)``: one C loop that also range-checks, the fastest
    conversion CPython offers. Raises ``ValueError`` naming the first bad value and its position
    (the real binding raises ``OverflowError``/``TypeError`` with no position, which is useless
    for a 100k-token prompt).
    """
    if type(tokens) is list:  # what a router hashes: the fast path, checked first
        buf = array("I")
        try:
            buf.fromlist(tokens)  # direct list access: faster than array("I", tokens)
        except (OverflowError, TypeError):
            _raise_first_bad_token(tokens)
            raise ValueError("tokens must be a sequence of integers") from None
        if _BIG_ENDIAN:
            buf.byteswap()
        return buf
    if isinstance(tokens, (str, bytes)):
        raise ValueError(f"tokens must be a sequence of integers, got {type(tokens).__name__}")
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iub":
            _raise_first_bad_token(tokens.tolist() if tokens.ndim == 1 else tokens)
            raise ValueError("tokens must be a one-dimensional sequence of integers")
        if tokens.size and tokens.dtype.kind != "b" and (tokens.min() < 0 or tokens.max() > U32_MAX):
            _raise_first_bad_token(tokens.tolist())
        return np.ascontiguousarray(tokens, dtype="<u4")
    try:
        buf = array("I", tokens)
    except (OverflowError, TypeError):
        _raise_first_bad_token(tokens)
        raise ValueError("tokens must be a sequence of integers") from None
    if _BIG_ENDIAN:
        buf.byteswap()
    return buf


def _raise_first_bad_token(tokens: Any) -> None:
    try:
        items = list(tokens)
    except TypeError:
        raise ValueError(f"tokens must be a sequence of integers, got {type(tokens).__name__}") from None
    for pos, t in enumerate(items):
        if isinstance(t, (bool, np.bool_)):
            continue
        if not isinstance(t, (int, np.integer)):
            raise ValueError(f"token at position {pos} is not an integer: {t!r}")
        if not 0 <= int(t) <= U32_MAX:
            raise ValueError(f"token at position {pos} is out of the u32 range [0, 2^32-1]: {int(t)}")


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"block size must be an integer, got {block_size!r}")
    if not 1 <= int(block_size) <= U32_MAX:
        raise ValueError(f"block size must be in [1, 2^32-1], got {int(block_size)}")


def _mm_suffix(info: Mapping[str, Any] | None, block: int) -> bytes:
    if info is None:
        return b""
    try:
        objects = info["mm_objects"]
        hashes = sorted(int(o["mm_hash"]) for o in objects)
        for o in objects:
            o["offsets"]  # the router's parser requires it, though it never reaches the hash
    except (KeyError, TypeError) as exc:
        raise ValueError(f"mm_infos[{block}] is malformed (missing {exc})") from None
    for h in hashes:
        if not 0 <= h <= U64_MASK:
            raise ValueError(f"mm_infos[{block}] has mm_hash outside the u64 range: {h}")
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def block_hashes(
    tokens: TokenInput,
    block_size: int,
    *,
    eagle: bool = False,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
    mm_infos: MmInfos | None = None,
) -> list[int]:
    """Unsigned 64-bit local block hashes, as the router computes them for a prompt.

    Equal to ``compute_block_hash_for_seq(tokens, block_size, mm_infos, lora_name, eagle,
    cache_namespace)`` for every valid input; invalid input raises ``ValueError``.
    """
    if type(block_size) is not int or not 1 <= block_size <= U32_MAX:  # the common case in one test
        _check_block_size(block_size)
    b = int(block_size)
    buf = as_u32_tokens(tokens)
    n = (max(len(buf) - 1, 0) if eagle else len(buf)) // b  # block_count, without re-checking b
    if n == 0:
        return []
    seed = salt_seed(lora_name, cache_namespace) if lora_name or cache_namespace else XXH3_SEED
    win = (b + 1 if eagle else b) * 4
    if mm_infos:
        return _hashes_with_mm(memoryview(buf).cast("B"), n, b * 4, win, seed, mm_infos)
    # One opaque (void) item per block window, stride B tokens, over the buffer itself: EAGLE
    # windows (B+1 tokens) overlap by one token. .tolist() makes the bytes objects in C.
    blocks = np.ndarray((n,), _window_dtype(win), buf, 0, (b * 4,)).tolist()
    return list(map(_xxh3, blocks, repeat(seed, n)))


@lru_cache(maxsize=256)
def _window_dtype(win: int) -> np.dtype:
    return np.dtype(f"V{win}")


def _hashes_with_mm(mv: memoryview, n: int, stride: int, win: int, seed: int, mm_infos: MmInfos) -> list[int]:
    out = []
    for i in range(n):
        s = i * stride
        info = mm_infos[i] if i < len(mm_infos) else None
        suffix = _mm_suffix(info, i)
        out.append(_xxh3(bytes(mv[s : s + win]) + suffix if suffix else mv[s : s + win], seed))
    return out


def next_sequence_hash(parent: int, local: int) -> int:
    """One link of the router's sequence-hash chain (seed is always 1337)."""
    return _xxh3(_pair.pack(parent, local), XXH3_SEED)


def sequence_hashes(local_hashes: Sequence[int]) -> list[int]:
    """The router's parent-chained sequence hashes for a list of local block hashes.

    LoRA and namespace reach the chain only through the local hashes.
    """
    out: list[int] = []
    for h in local_hashes:
        out.append(int(h) if not out else next_sequence_hash(out[-1], int(h)))
    return out


def compute_block_hash_for_seq(
    tokens: TokenInput,
    kv_block_size: int,
    block_mm_infos: MmInfos | None = None,
    lora_name: str | None = None,
    is_eagle: bool | None = None,
    cache_namespace: str | None = None,
) -> list[int]:
    """:func:`block_hashes` behind the router binding's exact signature (a router hasher)."""
    return block_hashes(
        tokens, kv_block_size, eagle=bool(is_eagle), lora_name=lora_name,
        cache_namespace=cache_namespace, mm_infos=block_mm_infos,
    )
