"""Regenerate ``router_vectors.jsonl`` from the REAL router (ai-dynamo-runtime), not from kvalign.

The file is the only place expected hashes are written down. Local hashes come from
``dynamo._core.compute_block_hash_for_seq``; sequence hashes are read back from a real in-process
``KvRouter`` that routed the same request (``tests/unit/dynamo_router.py``, the oracle
``test_sequence_hashes.py`` uses). Run against the pinned package to re-record them:
``.venv/bin/python tests/unit/vectors/make_router_vectors.py``.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/unit, for the shared router oracle

from dynamo_router import DynamoRouterOracle  # noqa: E402

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


def router_seq_hashes(oracle: DynamoRouterOracle, c: dict, local: list[int]) -> list[int]:
    """The sequence hashes the real router stored for this request, block by block."""
    got = oracle.chain(c["tokens"], c["block_size"], local, eagle=bool(c.get("is_eagle")), lora_name=c.get("lora_name"),
                       cache_namespace=c.get("cache_namespace"), mm_infos=c.get("block_mm_infos"))
    if [t for _, t in got.pairs] != local:
        raise SystemExit(f"{c['name']}: router stored tokens_hash path {got.pairs}, binding gives local hashes {local}")
    return [s for s, _ in got.pairs]


def main() -> None:
    version = importlib.metadata.version("ai-dynamo-runtime")
    records = []
    with DynamoRouterOracle() as oracle:  # first: it sets DYN_LOG etc. before dynamo._core is imported
        from dynamo._core import compute_block_hash_for_seq as H

        for c in cases():
            local = H(c["tokens"], c["block_size"], c.get("block_mm_infos"), c.get("lora_name"), c.get("is_eagle"), c.get("cache_namespace"))
            seq = router_seq_hashes(oracle, c, local)
            records.append({**c, "local_hashes": local, "seq_hashes": seq, "recorded_with": f"ai-dynamo-runtime {version}"})
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    print(f"wrote {OUT} ({len(records)} vectors, ai-dynamo-runtime {version}; seq_hashes read from the real KvRouter)")


if __name__ == "__main__":
    main()
