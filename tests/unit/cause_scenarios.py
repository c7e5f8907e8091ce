"""One real capture per catalog cause, and the ``kvalign diagnose`` command that names it.

Shared by ``test_diagnose.py`` (which runs every scenario through the CLI) and by hand, to
reproduce the diagnose reports quoted in the issue's closing note::

    .venv/bin/python tests/unit/cause_scenarios.py out/causes   # writes captures, prints commands

Each scenario drives SGLang's real radix cache, publishes through SGLang's real ZmqEventPublisher
over loopback and records with kvalign's capture loop; the misalignment is in the router flags, the
prompt, or the stream (a real lossy ZMQ hop), never in edited events.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_publisher import RealPublisher, Stream, captured

from kvalign.oracles.sglang import SglangRadixCache

B = 4
PROMPT = list(range(100, 121))  # 21 tokens: 5 plain pages of 4, or 5 pages of 4 bigrams
BOS = 1


@dataclass(frozen=True)
class Scenario:
    name: str
    eagle: bool  # the engine's EAGLE (bigram keys)
    drive: Callable[[SglangRadixCache, Stream], None]
    prompt: list[int]
    router_flags: tuple[str, ...]
    cause: str | None  # Cause member name diagnose must report
    first_block: int | None


def _insert(tokens: list[int], **kw: Any) -> Callable[[SglangRadixCache, Stream], None]:
    def drive(cache: SglangRadixCache, stream: Stream) -> None:
        cache.insert(tokens, **kw)
        stream.publish(cache.take_raw_events())
    return drive


def _evict_tail(cache: SglangRadixCache, stream: Stream) -> None:
    for tokens in (PROMPT, PROMPT[: 2 * B] + [7] * 12):  # the second shares 2 pages: the prompt's tail is a leaf
        cache.insert(tokens)
        stream.publish(cache.take_raw_events())
    cache.evict(1)  # SGLang evicts the least recently used leaf: the prompt's tail
    stream.publish(cache.take_raw_events())


def _lose_a_batch(cache: SglangRadixCache, stream: Stream) -> None:
    for end, drop in ((2 * B + 1, False), (3 * B + 1, True), (len(PROMPT), False)):
        cache.insert(PROMPT[:end])
        stream.publish(cache.take_raw_events(), drop=drop)


SCENARIOS = [
    Scenario("aligned", True, _insert(PROMPT), PROMPT, (), None, None),
    Scenario("router-eagle-off", True, _insert(PROMPT), PROMPT, ("--router-eagle", "off"), "ROUTER_EAGLE_OFF", 0),
    Scenario("router-eagle-on", False, _insert(PROMPT), PROMPT, ("--router-eagle", "on"), "ROUTER_EAGLE_ON", 0),
    Scenario("block-size", True, _insert(PROMPT), PROMPT, ("--block-size", "8"), "BLOCK_SIZE", 0),
    Scenario("lora-dropped", True, _insert(PROMPT, lora_name="loraA"), PROMPT, (), "LORA_DROPPED", 0),
    Scenario("namespace-dropped", True, _insert(PROMPT, cache_salt="tenant-1"), PROMPT, (), "NAMESPACE_DROPPED", 0),
    Scenario("seed-drift", True, _insert(PROMPT, cache_salt="tenant-1"), PROMPT, ("--namespace", "tenant-2"),
             "SEED_DRIFT", 0),
    Scenario("prompt-shift", True, _insert([BOS, *PROMPT]), PROMPT, (), "PROMPT_SHIFT", 0),  # k = -1
    Scenario("prompt-extra-token", True, _insert(PROMPT), [BOS, *PROMPT], (), "PROMPT_SHIFT", 0),  # k = +1
    Scenario("evicted", False, _evict_tail, PROMPT, (), "EVICTED", 2),
    Scenario("sequence-gap", True, _lose_a_batch, PROMPT, (), "SEQUENCE_GAP", 2),
    # the lost batch stored the prompt's last block; only a longer sequence's blocks arrive later
    Scenario("sequence-gap-last-block", True, _lose_a_batch, PROMPT[: 3 * B + 1], (), "SEQUENCE_GAP", 2),
    Scenario("prompt-too-short", True, _insert(PROMPT), PROMPT[:B], (), "PROMPT_TOO_SHORT", 0),
]


def record(scenario: Scenario, out_dir: str, publisher: RealPublisher | None = None) -> tuple[str, str]:
    """Write ``<name>.jsonl`` (the capture) and ``<name>.prompt.json``; returns both paths."""
    cache = SglangRadixCache(B, eagle=scenario.eagle)
    with captured(out_dir, publisher, name=f"{scenario.name}.jsonl", lossy=scenario.drive is _lose_a_batch) as stream:
        scenario.drive(cache, stream)
    prompt = os.path.join(out_dir, f"{scenario.name}.prompt.json")
    with open(prompt, "w") as f:
        json.dump(scenario.prompt, f)
    return stream.path, prompt


def diagnose_argv(scenario: Scenario, capture: str, prompt: str) -> list[str]:
    return ["diagnose", "--capture", capture, "--prompt", prompt, *scenario.router_flags]


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "out/causes"
    os.makedirs(out, exist_ok=True)
    shared = RealPublisher()
    try:
        for s in SCENARIOS:
            capture, prompt = record(s, out, shared)
            print(f".venv/bin/python -m kvalign {' '.join(diagnose_argv(s, capture, prompt))}")
    finally:
        shared.close()
