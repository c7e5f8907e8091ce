"""What a request must have stored, and whether the engine's own stream shows it yet.

The fuzz settles after each answer on what the engine's stream shows instead of a quiet window:
a request is settled once the serving worker's stream shows every page the request stored (each
page of the prompt and of what the worker cached of its output, either held when the request was
routed or stored since) and the router side has caught up with that stream. A fixed quiet window
cost every request ``quiet_s`` (0.4 s) whether or not anything was still coming, and still could
not tell a late store from none.

Which pages a finished request stores (SGLang's radix cache on insert, measured on the live engine,
0.5.23, EAGLE3, page 16): a prefill worker in disaggregation, or a request that generated one token,
caches the prompt alone; a worker that decoded ``M >= 2`` tokens caches the prompt and the generated
tokens but the last, or all of them when the last one's KV was computed too (a 49-token prompt that
generated 16 stored 4 pages, a 50-token prompt that generated 15 stored 3: 65 tokens both). A cached
sequence of ``c`` tokens holds ``c // B`` full pages, ``(c - 1) // B`` when pages hold bigrams (EAGLE).
So a request stores between ``lo`` and ``hi`` pages (:func:`stored_page_range`), and where they
differ the last one may or may not come.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvalign.model.events import EventBatch
from kvalign.model.hashing import block_hashes
from kvalign.model.relay import Relay, RouterStored


def cached_tokens_after(prompt: Sequence[int], output: Sequence[int], *, decodes: bool) -> list[int]:
    """The most tokens a finished request can leave in its worker's radix cache (its pages are the
    leading pages of these)."""
    return [*prompt, *output] if decodes and len(output) >= 2 else list(prompt)


def stored_pages(n_tokens: int, block_size: int, *, eagle: bool) -> int:
    """Full pages a cached sequence of ``n_tokens`` holds."""
    return max(n_tokens - 1 if eagle else n_tokens, 0) // block_size


def stored_page_range(prompt: int, output: int, block_size: int, *, eagle: bool, decodes: bool) -> tuple[int, int]:
    """(fewest, most) leading pages of :func:`cached_tokens_after` a finished request stores."""
    if not decodes or output < 2:
        n = stored_pages(prompt, block_size, eagle=eagle)
        return n, n
    return (stored_pages(prompt + output - 1, block_size, eagle=eagle),
            stored_pages(prompt + output, block_size, eagle=eagle))


def stores_seen(batches: Sequence[EventBatch], since: int, tokens: Sequence[int], held_at_mark: int, block_size: int,
                *, eagle: bool, namespace: str | None = None) -> int:
    """How many leading pages of ``tokens`` are accounted for: held when the request was routed
    (``held_at_mark``) or stored in ``batches[since:]`` (one worker's stream from a point where its
    cache was empty, so the relay knows every parent's namespace). Stored means the stream carried
    the page's token window, whatever became of it after (a store evicted in the same batch was
    still published)."""
    want = stored_pages(len(tokens), block_size, eagle=eagle)
    if want <= held_at_mark:
        return want
    query = block_hashes(list(tokens), block_size, eagle=eagle, cache_namespace=namespace)[:want]
    relay, seen = Relay(block_size), set()
    for j, batch in enumerate(batches):
        for ev in batch.events:
            conv = relay.convert(ev)
            if j >= since and isinstance(conv, RouterStored):
                seen.update(local for _, local in conv.blocks)
    k = 0
    while k < want and (k < held_at_mark or query[k] in seen):
        k += 1
    return k
