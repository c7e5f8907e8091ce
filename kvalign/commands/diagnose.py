"""``kvalign diagnose``: why the router's overlap for a prompt differs from what the engine cached.

Exit 0 when router and engine agree (the prompt may simply not be cached), 1 when a divergence is
found and named, 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvalign.commands.options import positive_int
from kvalign.diagnose import BlockView, Diagnosis, RouterSettings, diagnose
from kvalign.prompt import load_prompt


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="compare the router's block keys for a prompt with a worker's capture")
    p.add_argument("--capture", required=True, metavar="FILE", help="capture of the worker (kvalign capture)")
    p.add_argument("--prompt", required=True, metavar="PROMPT",
                   help="JSON file of token ids, or a text file with --tokenizer")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="local Hugging Face tokenizer directory for a text prompt")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="router kv_block_size (default: the engine's, from the capture)")
    p.add_argument("--router-eagle", choices=("auto", "on", "off"), default="auto",
                   help="router EAGLE hashing (auto: what the engine's events show)")
    p.add_argument("--lora", default=None, help="LoRA name the router hashes with")
    p.add_argument("--namespace", default=None, help="cache namespace (cache_salt) the router hashes with")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(run=run)


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
        f"(ever stored: {e['ever_stored']})",
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
        lines.append(f"cause: {d.cause.value if d.cause else 'unknown'}{qualifier}")
        lines.append(f"  {d.detail}")
    lines += [f"note: {n}" for n in d.notes]
    return "\n".join(lines)


def to_json(d: Diagnosis) -> dict:
    out = dataclasses.asdict(d)
    out["cause"] = None if d.cause is None else {"name": d.cause.name, "text": d.cause.value}
    return out


def run(args: argparse.Namespace) -> int:
    tokens = load_prompt(args.prompt, args.tokenizer)
    settings = RouterSettings(args.block_size, args.router_eagle, args.lora, args.namespace)
    d = diagnose(args.capture, tokens, settings)
    if args.json:
        json.dump(to_json(d), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(render(d))
    return 1 if d.cause is not None else 0
