"""The scalar-pad stand-in is SGLang 0.5.21's own rule, and only for the ``with`` block."""

from __future__ import annotations

import ast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvalign.standins.sglang_scalar_pads import scalar_pad_value, scalar_pads

U64 = st.integers(0, (1 << 64) - 1)


def _release_function(version: str, name: str):
    """``name`` from SGLang ``version``'s own ``schedule_batch.py`` (with its module constants)."""
    from kvalign.verify.report.matrix import ensure_release

    root = ensure_release("sglang", version)
    source = (root / "sglang" / "srt" / "managers" / "schedule_batch.py").read_text()
    tree = ast.parse(source)
    keep = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name == name) or
            (isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "MM_PAD_SHIFT_VALUE" for t in n.targets))]
    namespace: dict = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "schedule_batch.py", "exec"), namespace)
    return namespace[name]


@pytest.mark.slow  # reads the 0.5.21 wheel (kvalign matrix's cache; downloaded once if missing)
@given(U64)
def test_equals_sglang_0_5_21_compute_pad_value(item_hash):
    original = _compute_pad_value_0_5_21()
    assert scalar_pad_value(item_hash) == original(item_hash)


_cached: list = []


def _compute_pad_value_0_5_21():
    if not _cached:
        _cached.append(_release_function("0.5.21", "_compute_pad_value"))
    return _cached[0]


@pytest.mark.slow  # imports SGLang 0.5.23's schedule_batch
@given(U64)
def test_patches_0_5_23_set_hash_for_the_block_only(item_hash):
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem

    with scalar_pads():
        item = MultimodalDataItem(modality=Modality.IMAGE)
        item.set_hash(item_hash)
        assert item.pad_values == (scalar_pad_value(item_hash),) and item.padding_sequence(3) == [item.pad_value] * 3
    item.set_hash(item_hash)
    assert len(item.pad_values) == 4 and item.pad_value != scalar_pad_value(item_hash)
