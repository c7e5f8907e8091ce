"""``diagnose`` for image prompts: find the engine's pages of the prompt that the router never saw.

A capture shows one multimodal cause for certain:

* ``MM_PAD_WIDTH`` — SGLang published the prompt's pages with pad values above u32 (0.5.23's
  62-bit sentinels), or in one batch with another request's such pages, and Dynamo's relay, which
  decodes token ids as u32, dropped the whole batch: text pages too, and a text-only prompt's. The replay drops that batch the same way, so these pages are looked for
  in the capture's raw events (the capture keeps such token ids losslessly);
* a note, not a cause: the engine's pages match the prompt through its text, then hold an image run
  of other u32 pad values than the prompt's. That is what another image looks like too, so only
  ``kvalign check --property mm`` (same image, both sides) can tell a pad mismatch from it.

Pages are matched through the capture's parent links: each stored page's full token sequence is
its parent's plus its own window, so a page whose parent was published earlier is still placed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvalign.model.causes import Cause
from kvalign.model.mm_keys import pad_runs, wide_tokens
from kvalign.streams.capture import CaptureReader, Stored, u64_list


@dataclass(frozen=True)
class MmEvidence:
    """``cause`` None: a note, not a finding (the capture cannot tell a pad mismatch from another image)."""

    cause: Cause | None
    detail: str
    seq: int | None
    #: leading tokens of the prompt the engine's matching page covers (it holds them; the replay does not)
    common: int = 0


def _tokens(ev: Stored) -> list[int] | None:
    """The event's raw token sequence (pairs flattened as Dynamo's relay flattens them), or None for
    a token list that is neither ids nor id pairs (a hostile capture: the replay counts it malformed)."""
    if ev.tok is not None:
        toks = list(ev.tok)
        if toks and all(isinstance(p, list) and len(p) == 2 and all(type(t) is int for t in p) for p in toks):
            return [p[0] for p in toks] + [toks[-1][1]]
        if all(type(t) is int for t in toks):
            return toks
        return None
    return [int.from_bytes(ev.t[i:i + 4], "little") for i in range(0, len(ev.t), 4)]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def mm_evidence(capture: str, prompt: list[int], block_size: int) -> MmEvidence | None:
    """Why the router cannot credit the engine's pages of ``prompt``, from the capture: None when no
    page of the prompt (at least one whole block of it) sits in a batch the relay dropped for its
    token width, and the prompt's image runs, if any, are not the reason."""
    runs = pad_runs(prompt)
    chains: dict[int, list[int]] = {}  # engine hash -> the full token sequence up to that page's end
    dropped: tuple[int, list[int], int | None, list[int]] | None = None  # (common, engine seq, batch seq, wide ids)
    kept: tuple[int, list[int]] | None = None
    with CaptureReader(capture) as reader:
        for batch in reader.batches():
            stored = [ev for ev in batch.ev or [] if isinstance(ev, Stored)]
            wide_in_batch = [t for ev in stored if ev.tok is not None for t in wide_tokens(_tokens(ev) or [])]
            for ev in stored:
                raw = _tokens(ev)
                if raw is None:
                    continue
                prefix = chains.get(ev.p, []) if ev.p is not None else []
                pairs = 1 if ev.pairs else 0
                for i, h in enumerate(u64_list(ev.h)):
                    seq = prefix + raw[: (i + 1) * ev.bs + pairs]
                    chains[h] = prefix + raw[: (i + 1) * ev.bs]
                    common = _common(seq, prompt)
                    if common < block_size:
                        continue
                    if wide_in_batch and (dropped is None or common > dropped[0]):
                        dropped = (common, seq, batch.seq, wide_in_batch)
                    elif not wide_in_batch and (kept is None or common > kept[0]):
                        kept = (common, seq)
    if dropped is not None:
        common, engine, seq, wide = dropped
        own = wide_tokens(engine)
        how = (f"the first {common} tokens as the prompt, then an image keyed by pad values such as {own[0]}, above "
               "u32" if own else f"the first {common} tokens as the prompt, in one batch with another request's "
               f"image pages keyed by pad values such as {wide[0]}, above u32")
        image = (f"; the prompt's own image pads ({runs[0].values[0]}, ...) are not SGLang's either" if runs and own
                 else "")
        return MmEvidence(Cause.MM_PAD_WIDTH, (
            f"the engine stored this prompt's pages in batch seq {seq}: {how}; Dynamo's relay decodes token ids as "
            f"u32 and drops every batch holding a wider one, text pages included, so the router never indexed "
            f"them{image}"), seq, common)
    if kept is not None and runs:
        common, engine = kept
        engine_runs = pad_runs(engine)
        if engine_runs and engine_runs[0].start == runs[0].start and engine_runs[0].values[0] != runs[0].values[0]:
            return MmEvidence(None, (
                f"the engine's pages match this prompt through token {common - 1}, then hold an image keyed by pad "
                f"value {engine_runs[0].values[0]} where the prompt has {runs[0].values[0]}: another image, or a "
                "frontend whose pad values differ from SGLang's (kvalign check --property mm tells which)"), None)
    return None
