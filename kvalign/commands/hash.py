"""``kvalign hash``: the router's block hashes for token ids read as JSON from stdin."""

from __future__ import annotations

import argparse
import json
import sys

from kvalign.errors import UsageError
from kvalign.model.hashing import block_hashes, sequence_hashes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hash", help="hash token ids (JSON list on stdin) into router block hashes")
    p.add_argument("--block-size", type=int, required=True, help="KV block (page) size B")
    p.add_argument("--eagle", action="store_true", help="EAGLE windows: B+1 tokens at stride B")
    p.add_argument("--lora", default=None, help="LoRA name (enters the seed)")
    p.add_argument("--namespace", default=None, help="cache namespace / cache_salt (enters the seed)")
    p.add_argument("--sequence", action="store_true", help="print the sequence-hash chain instead")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    text = sys.stdin.read()
    try:
        tokens = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"stdin is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(tokens, list):
        raise UsageError(f"stdin must be a JSON list of token ids, got {type(tokens).__name__}")
    hashes = block_hashes(tokens, args.block_size, eagle=args.eagle, lora_name=args.lora, cache_namespace=args.namespace)
    json.dump(sequence_hashes(hashes) if args.sequence else hashes, sys.stdout)
    sys.stdout.write("\n")
    return 0
