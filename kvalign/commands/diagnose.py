"""``kvalign diagnose``: why the router's overlap for a prompt differs from what the engine cached.

One ``--capture``: the single-worker report (first divergent block and its cause). Two or more
(or ``--router-worker`` / ``--router-kv-hit-rate``): the routing report, one row per worker.

Exit 0 when router and engine agree (the prompt may simply not be cached), 1 when a divergence is
found and named, or a finding such as HOST_CREDIT_NOT_SERVABLE applies (or the router's reported
kv_hit_rate is not reproduced), 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvalign.commands.options import positive_int
from kvalign.errors import UsageError
from kvalign.model.causes import cause_class
from kvalign.streams.diagnose import BlockView, Diagnosis, RouterSettings, diagnose
from kvalign.streams.diagnose_workers import RoutingDiagnosis, check_worker_names, diagnose_workers
from kvalign.streams.prompt import load_prompt


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="compare the router's block keys for a prompt with a worker's capture")
    p.add_argument("--capture", required=True, action="append", metavar="FILE",
                   help="capture of a worker (kvalign capture); repeat once per worker to explain a routing decision")
    p.add_argument("--worker", action="append", default=None, metavar="NAME",
                   help="name of each --capture, in order (e.g. the worker_id nvext reports; default: file stem)")
    p.add_argument("--router-worker", default=None, metavar="NAME",
                   help="the worker the router chose (nvext.worker_id, as named with --worker)")
    p.add_argument("--router-kv-hit-rate", type=_rate, default=None, metavar="X",
                   help="the kv_hit_rate the router reported for this request (nvext timing)")
    p.add_argument("--prompt", required=True, metavar="PROMPT",
                   help="JSON file of token ids, or a text file with --tokenizer")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="local Hugging Face tokenizer directory for a text prompt")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="router kv_block_size (default: the engine's, from the capture)")
    p.add_argument("--router-eagle", choices=("auto", "on", "off"), default="auto",
                   help="router EAGLE hashing (auto: what the engine's events show; with several captures, the first one's)")
    p.add_argument("--lora", default=None, help="LoRA name the router hashes with")
    p.add_argument("--namespace", default=None, help="cache namespace (cache_salt) the router hashes with")
    p.add_argument("--engine-reused", type=int, default=None, metavar="TOKENS",
                   help="the tokens the engine reported reusing for this prompt (cached_tokens; one --capture): when "
                        "its own events do not show those pages, the cause is the engine's events")
    p.add_argument("--routed-at-batch", type=int, default=None, metavar="K",
                   help="with --engine-reused: the capture's batches that had arrived when the request was routed "
                        "(a live fuzz failure records it); pages stored after them were published late")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(run=run)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _fmt_tokens(tokens: list[int | None], limit: int = 12) -> str:
    shown = ["?" if t is None else str(t) for t in tokens[:limit]]
    return "[" + ", ".join(shown) + (", ..." if len(tokens) > limit else "") + "]"


def _fmt_view(side: str, v: BlockView) -> str:
    h = "none" if v.hash is None else f"{v.hash:#018x}"
    line = f"  {side:<6} tokens[{v.start}:{v.end}] {_fmt_tokens(v.tokens)}  key {h}"
    if v.engine_block_hash is not None:
        line += f"  (SGLang block hash {v.engine_block_hash}"
        line += f", stored at seq {v.stored_seq}" if v.stored_seq is not None else ", never received"
        line += f", removed at seq {v.removed_seq}" if v.removed_seq is not None else ""
        line += ")"
    return line


def render(d: Diagnosis) -> str:
    r, e = d.router, d.engine

    def rate(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    def flags(s: dict) -> str:
        return (f"block size {s['block_size']}, eagle {'on' if s['eagle'] else 'off'}, "
                f"lora {s['lora'] or '-'}, namespace {s['namespace'] or '-'}")

    lines = [
        f"capture {d.capture}: {d.capture_stats['batches']} batches, {e['stored_events']} stored events; "
        f"prompt {d.prompt_tokens} tokens",
        f"router ({flags(r)}{', eagle from engine' if r['eagle_mode'] == 'auto' else ''}): "
        f"predicted overlap {r['overlap']}/{r['blocks']} blocks, kv_hit_rate {rate(r['kv_hit_rate'])}",
        f"engine ({flags(e)}): overlap {e['overlap']}/{e['blocks']} blocks, kv_hit_rate {rate(e['kv_hit_rate'])} "
        f"(ever stored: {e['ever_stored']}"
        + (f"; holds at least {e['holds']}, counting blocks stored in batches the capture lost" if e["holds"] > e["overlap"] else "")
        + ")",
    ]
    if d.first_divergent is None:
        lines.append(f"no divergence: {d.detail}")
    else:
        lines.append(f"first divergent block: {d.first_divergent}")
        if d.router_block:
            lines.append(_fmt_view("router", d.router_block))
        if d.engine_block:
            lines.append(_fmt_view("engine", d.engine_block))
        qualifier = f" (k = {d.shift:+d})" if d.shift is not None else ""
        qualifier += f" ({d.confidence})" if d.confidence else ""
        klass = f" [{cause_class(d.cause)}]" if d.cause else ""
        lines.append(f"cause: {d.cause.value if d.cause else 'unknown'}{qualifier}{klass}")
        lines.append(f"  {d.detail}")
    lines += [f"finding: {f}" for f in d.findings]
    lines += [f"note: {n}" for n in d.notes]
    return "\n".join(lines)


def to_json(d: Diagnosis) -> dict:
    out = dataclasses.asdict(d)
    out["cause"] = None if d.cause is None else {"name": d.cause.name, "text": d.cause.value,
                                                 "class": cause_class(d.cause)}
    return out


def render_routing(rd: RoutingDiagnosis) -> str:
    r = rd.router
    eagle = f"eagle {'on' if r['eagle'] else 'off'}" + (f" (from {r['eagle_from']}'s events)" if r["eagle_from"] else "")
    lines = [f"prompt {rd.prompt_tokens} tokens, {r['blocks']} router blocks (kv_hit_rate = overlap / "
             f"{r['isl_blocks']}); router: block size {r['block_size']}, {eagle}, lora {r['lora'] or '-'}, "
             f"namespace {r['namespace'] or '-'}"]
    rows = [("worker", "router overlap", "kv_hit_rate", "engine holds", "cause")]
    for v in rd.workers:
        d = v.diagnosis
        cause = "-" if d.cause is None else d.cause.value + (f" (k = {d.shift:+d})" if d.shift is not None else "") + (
            f" ({d.confidence})" if d.confidence else "")
        mark = " *" if rd.reported is not None and rd.reported.worker == v.name else ""
        rows.append((v.name + mark, f"{v.router_overlap}/{v.blocks}",
                     "n/a" if v.kv_hit_rate is None else f"{v.kv_hit_rate:.2f}", f"{v.engine_overlap}/{v.blocks}", cause))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    if rd.reported is not None and rd.reported.worker is not None:
        rate = "" if rd.reported.kv_hit_rate is None else f", kv_hit_rate {rd.reported.kv_hit_rate:.3g}"
        lines.append(f"router reported: {rd.reported.worker}{rate} (marked *)")
    lines.append(f"verdict: {rd.verdict}")
    lines += [f"finding: {f}" for f in rd.findings]
    for v in rd.workers:
        lines += [f"note: {v.name}: {n}" for n in v.diagnosis.notes]
    return "\n".join(lines)


def routing_json(rd: RoutingDiagnosis) -> dict:
    return {
        "prompt_tokens": rd.prompt_tokens, "router": rd.router, "favoured": rd.favoured,
        "aligned_favoured": rd.aligned_favoured, "verdict": rd.verdict, "findings": rd.findings,
        "misaligned": rd.misaligned, "reported": None if rd.reported is None else dataclasses.asdict(rd.reported),
        "workers": [{"name": v.name, "capture": v.capture, "router_overlap": v.router_overlap,
                     "kv_hit_rate": v.kv_hit_rate, "engine_overlap": v.engine_overlap, "blocks": v.blocks,
                     "diagnosis": to_json(v.diagnosis)} for v in rd.workers],
    }


def run(args: argparse.Namespace) -> int:
    tokens = load_prompt(args.prompt, args.tokenizer)
    settings = RouterSettings(args.block_size, args.router_eagle, args.lora, args.namespace)
    captures = args.capture
    check_worker_names(captures, args.worker)
    if args.engine_reused is not None and (len(captures) > 1 or args.engine_reused < 0):
        raise UsageError("--engine-reused takes one --capture (the worker that served the prompt) and a count >= 0")
    if args.routed_at_batch is not None and (args.engine_reused is None or args.routed_at_batch < 0):
        raise UsageError("--routed-at-batch needs --engine-reused and a count >= 0")
    if len(captures) > 1 or args.router_worker is not None or args.router_kv_hit_rate is not None:
        rd = diagnose_workers(captures, tokens, settings, names=args.worker, reported_worker=args.router_worker,
                              reported_kv_hit_rate=args.router_kv_hit_rate)
        if args.json:
            json.dump(routing_json(rd), sys.stdout)
            sys.stdout.write("\n")
        else:
            print(render_routing(rd))
        return 1 if rd.misaligned else 0
    d = diagnose(captures[0], tokens, settings, engine_reused=args.engine_reused, routed_at=args.routed_at_batch)
    if args.json:
        json.dump(to_json(d), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(render(d))
    return 1 if d.cause is not None or d.findings else 0
