"""What a maintainer reads first about a finding: the pair's status, the finding's class and bound, and
whether it was reproduced on the real engine.

A finding on a pair Dynamo does not ship (its ``ai-dynamo[sglang]`` extra pins another SGLang) is news
of another kind than one on the shipped pair, and a property's finding that no live run reproduced is
a claim, not an observation; both are said before anything else. :data:`LIVE` records the live runs
behind each published finding (the command, or None where none reproduced it), so the report, the
matrix's Markdown and the README say the same thing.
"""

from __future__ import annotations

from typing import Any

from kvalign.model.causes import CREDIT_SKEW, SCOPED

#: (cause, ai-dynamo, sglang) -> (the command that reproduced the finding on the real CPU engine, where its run
#: is told), or None where it was not reproduced live (the DP rows of 1.5.1 x 0.5.23: no live run of that
#: pair's DP workers).
LIVE: dict[tuple[str, str, str], tuple[str, str] | None] = {
    ("HOST_CREDIT_NOT_SERVABLE", "1.6.1", "0.5.23"):
        ("kvalign e2e fuzz --engine sglang-cpu --hicache --page-size 4 --json",
         "exit 1, HOST_CREDIT_NOT_SERVABLE: docs/live-fuzz.md"),
    ("STORAGE_TIER_UNCREDITED", "1.6.1", "0.5.23"):
        ("kvalign e2e fuzz --engine sglang-cpu --hicache --storage file --json",
         "exit 1, STORAGE_TIER_UNCREDITED: docs/live-fuzz.md"),
    ("MM_PAD_WIDTH", "1.6.1", "0.5.23"): ("kvalign e2e mm", "tests/e2e/test_mm_live.py, docs/multimodal.md"),
    ("DP_RANK_UNSUBSCRIBED", "1.5.1", "0.5.23"): None,
    ("DP_RANK_UNREGISTERED", "1.5.1", "0.5.23"): None,
}
NOT_LIVE = "not reproduced live"


def live_note(cause: str, dynamo: str, sglang: str) -> str:
    """``reproduced live: `COMMAND` (where)`` or ``not reproduced live`` (also where no live run of the pair is
    recorded)."""
    run = LIVE.get((cause, dynamo, sglang))
    return f"reproduced live: `{run[0]}` ({run[1]})" if run else NOT_LIVE


def pair_status(dynamo: str, sglang: str, shipped: str | None) -> str:
    """Whether the pair is one Dynamo ships: ``shipped`` is the SGLang its ``ai-dynamo[sglang]`` extra pins."""
    if shipped is None:
        return f"ai-dynamo {dynamo} pins no SGLang release; sglang {sglang} is the one checked"
    if shipped == sglang:
        return f"shipped together: ai-dynamo {dynamo}'s `sglang` extra pins sglang {sglang}"
    return (f"not shipped together: ai-dynamo {dynamo}'s `sglang` extra pins sglang {shipped}, not {sglang} (a "
            "deployment that upgrades SGLang past its Dynamo's pin)")


def opening(data: dict[str, Any], shipped: str | None) -> list[str]:
    """The report's first lines (Markdown): status, class and bound, live reproduction."""
    v = data["versions"]
    dynamo, sglang = v["ai-dynamo"], v["sglang"]
    klass = data["class"]
    if klass == CREDIT_SKEW:
        if not data.get("impact"):
            raise ValueError(f"{data['cause']} is a credit skew, and the collected data has no bound / routing impact")
        what = f"an advisory (`kvalign check` exits 0 on it, `--strict` 1): {data['impact']}"
    elif klass == SCOPED:
        what = "counted apart from the mismatches (never fails a row)"
    else:
        what = ("the router's keys, card or events disagree with the engine's: credit is lost or invented without "
                "bound (`kvalign check` exits 1)")
    lines = [f"**Status:** {pair_status(dynamo, sglang, shipped)}.  ",
             f"**Class:** {klass}, {what}.  "]
    if klass not in (CREDIT_SKEW, SCOPED) and data.get("impact"):
        lines.append(f"**Routing impact (measured):** {data['impact']}.  ")
    return [*lines, f"**Live:** {live_note(data['cause'], dynamo, sglang)}.  "]
