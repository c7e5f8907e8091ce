"""Regenerate ``router_vectors.jsonl`` from the REAL router binding (ai-dynamo-runtime).

The file is the only place expected hashes are written down, and every value in it was computed
by ``dynamo._core.compute_block_hash_for_seq`` — run this script against the pinned package to
re-record them:  ``.venv/bin/python tests/unit/vectors/make_router_vectors.py``.
Sequence hashes are the router's chain over those local hashes (kvalign.hashing.sequence_hashes;
the chain is checked against the router by dynamo-router-hashing.md §5).
"""

from __future__ import annotations

import importlib.metadata
import json
import random
from pathlib import Path

from dynamo._core import compute_block_hash_for_seq as H

from kvalign.hashing import sequence_hashes

OUT = Path(__file__).with_name("router_vectors.jsonl")


def cases() -> list[dict]:
    rng = random.Random(20261202)
    toks49 = [rng.randrange(200_000) for _ in range(49)]
    return [
        {"name": "empty", "tokens": [], "block_size": 4},
        {"name": "short N<B", "tokens": [1, 2, 3], "block_size": 4},
        {"name": "N==B normal", "tokens": [1, 2, 3, 4], "block_size": 4},
        {"name": "N==B eagle (0 blocks)", "tokens": [1, 2, 3, 4], "block_size": 4, "is_eagle": True},
        {"name": "N==B+1 eagle", "tokens": [1, 2, 3, 4, 5], "block_size": 4, "is_eagle": True},
        {"name": "N=10 normal", "tokens": list(range(10)), "block_size": 4},
        {"name": "N=10 eagle", "tokens": list(range(10)), "block_size": 4, "is_eagle": True},
        {"name": "B=1 eagle", "tokens": [5, 6, 7], "block_size": 1, "is_eagle": True},
        {"name": "max u32 tokens", "tokens": [2**32 - 1, 0, 2**31, 2**32 - 2], "block_size": 2},
        {"name": "lora", "tokens": list(range(100, 116)), "block_size": 8, "lora_name": "loraA"},
        {"name": "cache_namespace", "tokens": list(range(100, 116)), "block_size": 8, "cache_namespace": "tenant-1"},
        {"name": "empty lora/namespace == absent", "tokens": list(range(100, 116)), "block_size": 8, "lora_name": "", "cache_namespace": ""},
        {"name": "non-ASCII lora", "tokens": list(range(100, 116)), "block_size": 8, "lora_name": "ü-名前"},
        {"name": "lora+ns+eagle", "tokens": list(range(100, 117)), "block_size": 8, "lora_name": "loraA", "is_eagle": True, "cache_namespace": "tenant-1"},
        {"name": "mm block1 unsorted", "tokens": list(range(8)), "block_size": 4,
         "block_mm_infos": [None, {"mm_objects": [{"mm_hash": 9, "offsets": []}, {"mm_hash": 3, "offsets": []}]}]},
        {"name": "mm + eagle", "tokens": list(range(9)), "block_size": 4, "is_eagle": True,
         "block_mm_infos": [{"mm_objects": [{"mm_hash": 2**64 - 1, "offsets": [[0, 4]]}]}]},
        {"name": "B=16 random 49 eagle", "tokens": toks49, "block_size": 16, "is_eagle": True},
        {"name": "B=16 random 49 normal", "tokens": toks49, "block_size": 16},
        {"name": "B=64 random 200 u32", "tokens": [rng.randrange(2**32) for _ in range(200)], "block_size": 64},
    ]


def main() -> None:
    version = importlib.metadata.version("ai-dynamo-runtime")
    with OUT.open("w") as f:
        for c in cases():
            local = H(c["tokens"], c["block_size"], c.get("block_mm_infos"), c.get("lora_name"), c.get("is_eagle"), c.get("cache_namespace"))
            rec = {**c, "local_hashes": local, "seq_hashes": sequence_hashes(local), "recorded_with": f"ai-dynamo-runtime {version}"}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} ({len(cases())} vectors, ai-dynamo-runtime {version})")


if __name__ == "__main__":
    main()
