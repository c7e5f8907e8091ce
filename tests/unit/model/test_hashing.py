"""kvalign.model.hashing against the real router binding (ai-dynamo-runtime, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from kvalign.model.causes import Cause
from kvalign.verify.runner.check import run_search
from kvalign.model.hashing import block_count, block_hashes, compute_block_hash_for_seq, salt_seed, sequence_hashes
from kvalign.verify.misaligned import drop_lora, drop_namespace, eagle_b_window, flip_eagle, ignore_eagle
from kvalign.verify.engine.properties import Mismatch, hash_property
from kvalign.verify.engine.strategies import hash_cases

VECTORS = [json.loads(line) for line in Path(__file__).resolve().parents[1].joinpath("vectors").joinpath("router_vectors.jsonl").read_text().splitlines()]


@settings(max_examples=settings.default.max_examples * 10)
@given(case=hash_cases())
def test_block_hashes_equal_router_binding(router_hasher, count_case, case):
    count_case()
    hash_property(router_hasher, case)


@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize("b", [1, 2, 3, 16, 64, 128])
@pytest.mark.parametrize("extra", [-1, 0, 1, 2], ids=["B-1", "B", "B+1", "B+2"])
@pytest.mark.parametrize("blocks", [0, 1, 2])
def test_block_count_edges_match_binding(router_hasher, b, eagle, extra, blocks):
    n = max(0, blocks * b + extra)
    tokens = list(range(7, 7 + n))
    got = block_hashes(tokens, b, eagle=eagle)
    assert got == router_hasher(tokens, b, None, None, eagle, None)
    assert len(got) == block_count(n, b, eagle=eagle) == ((max(n - 1, 0) // b) if eagle else n // b)


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_recorded_router_vectors(vec):
    """Vectors recorded from the real binding (see vectors/make_router_vectors.py); runs without Dynamo."""
    got = block_hashes(vec["tokens"], vec["block_size"], eagle=bool(vec.get("is_eagle")), lora_name=vec.get("lora_name"),
                       cache_namespace=vec.get("cache_namespace"), mm_infos=vec.get("block_mm_infos"))
    assert got == vec["local_hashes"]
    assert sequence_hashes(got) == vec["seq_hashes"]


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_recorded_vectors_still_match_installed_router(router_hasher, vec):
    """Catches a router upgrade that changes hashing (then re-record and investigate)."""
    assert router_hasher(vec["tokens"], vec["block_size"], vec.get("block_mm_infos"), vec.get("lora_name"),
                         vec.get("is_eagle"), vec.get("cache_namespace")) == vec["local_hashes"]


def test_accepts_numpy_and_tuples(router_hasher):
    toks = list(range(1000, 1040))
    ref = router_hasher(toks, 8, None, None, True, None)
    for form in (np.array(toks, dtype=np.int64), np.array(toks, dtype=np.uint32), tuple(toks), [np.int64(t) for t in toks]):
        assert block_hashes(form, 8, eagle=True) == ref


def test_seed_is_additive_and_empty_names_are_absent():
    assert salt_seed("", "") == salt_seed() == 1337
    assert salt_seed("a", None) != salt_seed(None, "a")  # different xxh3 seeds for lora (0) and namespace (1)


@pytest.mark.parametrize(
    ("tokens", "block_size", "message"),
    [
        ([1, -1, 3], 1, "position 1 is out of the u32 range"),
        ([1, 2, 2**32], 1, "position 2 is out of the u32 range"),
        ([0, 2**64], 1, "position 1 is out of the u32 range"),
        ([1, 1.0], 1, "position 1 is not an integer"),
        ([1, "2"], 1, "position 1 is not an integer"),
        (np.array([1.0, 2.0]), 1, "position 0 is not an integer"),
        (np.array([5, -7], dtype=np.int64), 1, "position 1 is out of the u32 range"),
        ("1234", 2, "sequence of integers"),
        ([1, 2], 0, "block size must be in [1, 2^32-1], got 0"),
        ([1, 2], -3, "block size must be in [1, 2^32-1], got -3"),
        ([1, 2], 2**32, "block size must be in"),
    ],
)
def test_invalid_input_names_value_and_position(tokens, block_size, message):
    with pytest.raises(ValueError, match=None) as err:
        block_hashes(tokens, block_size)
    assert message in str(err.value)


def test_router_signature_adapter_is_a_valid_hasher(router_hasher):
    toks = list(range(50))
    assert compute_block_hash_for_seq(toks, 4, None, "L", True, "ns") == router_hasher(toks, 4, None, "L", True, "ns")


NEGATIVE = [
    (ignore_eagle, dict(eagle=True), {Cause.ROUTER_EAGLE_OFF}),
    (flip_eagle, dict(eagle=False), {Cause.ROUTER_EAGLE_ON}),
    (eagle_b_window, dict(eagle=True), {Cause.EAGLE_B_WINDOW}),
    (drop_lora, dict(lora=True, namespace=False), {Cause.LORA_DROPPED}),
    (drop_namespace, dict(lora=False, namespace=True), {Cause.NAMESPACE_DROPPED}),
]


@pytest.mark.parametrize(("hasher", "kw", "causes"), NEGATIVE, ids=[n[0].__name__ for n in NEGATIVE])
def test_negative_control_hash_property_detects_misaligned_router(router_hasher, hasher, kw, causes):
    _, _, found = run_search(lambda case: hash_property(hasher, case), hash_cases(mm=False, **kw), 200)
    assert isinstance(found, Mismatch), f"{hasher.__name__} was not detected"
    assert found.cause in causes
