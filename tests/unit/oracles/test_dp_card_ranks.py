"""The ranks a data-parallel worker's card registers (issue 36): a missing ``data_parallel_size`` is an error
naming it, never 1 (which would fabricate DP_RANK_UNREGISTERED for every rank past the first)."""

from __future__ import annotations

import types

import pytest

from kvalign.cli import main
from kvalign.errors import MissingValue
from kvalign.oracles.dp_dynamo import registered_ranks


def test_the_card_s_ranks_are_its_start_and_size():
    assert registered_ranks(types.SimpleNamespace(data_parallel_start_rank=2, data_parallel_size=2)) == range(2, 4)
    assert registered_ranks(types.SimpleNamespace(data_parallel_size=4)) == range(0, 4)


@pytest.mark.parametrize("card", [types.SimpleNamespace(data_parallel_start_rank=0),
                                  types.SimpleNamespace(data_parallel_start_rank=0, data_parallel_size=None)])
def test_a_card_without_data_parallel_size_is_an_error_naming_it(card):
    with pytest.raises(MissingValue, match="has no data_parallel_size"):
        registered_ranks(card)


def test_a_missing_value_exits_2_with_one_line_naming_it(monkeypatch, capsys):
    def raise_missing(*_a, **_k):
        raise MissingValue("data_parallel_size", "the card dynamo.sglang's get_runtime_config built")

    # raised where the check starts reading the real systems (before SGLang is imported: the test stays cheap);
    # --jobs 1: in this process, where the patch is (a spawned worker would import the real one)
    monkeypatch.setattr("kvalign.oracles.dynamo.load_router_hasher", raise_missing)
    assert main(["check", "--property", "dp", "--examples", "1", "--jobs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no data_parallel_size" in err[0] and "Traceback" not in err[0], err
