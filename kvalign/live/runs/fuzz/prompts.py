"""Prompts drawn from a prefix tree, as JSON-able specs resolved against the example's history.

A spec says how to build a prompt, not its tokens, so a replay script rebuilds exactly the same
prompts on another cluster — including follow-ups, whose tokens depend on what the engine
generated. Kinds:

* ``fresh``: ``length`` new tokens (a new branch of the tree);
* ``extend``: the first ``cut`` tokens of an earlier prompt, then new tokens up to ``length``
  (shared prefixes, cut anywhere: inside a page, at a boundary, one past it);
* ``follow_up``: an earlier prompt *plus its generated tokens*, then ``extra`` new tokens — the
  engine cached those generated tokens when the request finished (EAGLE commits their bigrams
  then), so the follow-up's reuse exercises cached decode tokens.

New tokens come from ``random.Random(seed)`` over ids the tiny model's vocabulary holds, so a
spec shrinks to seed 0 and two seeds never share a page by accident.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

TOKEN_LO, TOKEN_HI = 10, 500  # inside the tiny model's vocabulary (512), clear of its special ids
MAX_PROMPT = 300


@dataclass(frozen=True)
class Sent:
    """A prompt this example sent, with the tokens the engine generated for it."""

    tokens: tuple[int, ...]
    output: tuple[int, ...]


def new_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(max(n, 0))]


def resolve(spec: dict[str, Any], history: Sequence[Sent]) -> list[int]:
    """The tokens of ``spec`` given the prompts sent so far (by index, oldest first)."""
    kind = spec["kind"]
    if kind == "fresh" or not history:
        return new_tokens(spec["seed"], spec.get("length") or spec.get("extra") or 1)
    base = history[spec["of"] % len(history)]
    if kind == "extend":
        head = list(base.tokens[: min(spec["cut"], len(base.tokens))])
        return head + new_tokens(spec["seed"], spec["length"] - len(head))
    if kind == "follow_up":
        return [*base.tokens, *base.output, *new_tokens(spec["seed"], spec["extra"])][:MAX_PROMPT + 32]
    raise ValueError(f"unknown prompt kind {kind!r}")


def lengths(block_size: int, max_len: int = MAX_PROMPT) -> st.SearchStrategy[int]:
    """Prompt lengths, half of them at, one past or two past a page boundary (where EAGLE's
    B+1-token windows and SGLang's last-token rule change the counts)."""
    boundary = st.builds(lambda k, d: min(k * block_size + d, max_len),
                         st.integers(1, max_len // block_size), st.sampled_from((0, 1, 2)))
    return st.one_of(boundary, st.integers(1, max_len))


def prompt_specs(block_size: int) -> st.SearchStrategy[dict[str, Any]]:
    """One prompt spec; ``of`` indexes the history modulo its length."""
    seed, of = st.integers(0, 2**16), st.integers(0, 63)
    fresh = st.fixed_dictionaries({"kind": st.just("fresh"), "seed": seed, "length": lengths(block_size)})
    extend = st.fixed_dictionaries({"kind": st.just("extend"), "of": of, "cut": lengths(block_size),
                                    "seed": seed, "length": lengths(block_size)})
    follow = st.fixed_dictionaries({"kind": st.just("follow_up"), "of": of, "seed": seed,
                                    "extra": st.sampled_from((0, 1, 2, block_size - 1, block_size, block_size + 1))})
    return st.one_of(fresh, extend, follow)


def max_tokens() -> st.SearchStrategy[int]:
    return st.integers(1, 16)
