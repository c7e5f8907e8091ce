"""The nightly scenario's options and report (the live parts run in tests/e2e/test_disagg_eagle.py)."""

from __future__ import annotations

import pytest

from kvalign.live.wire.client import ChatResult
from kvalign.live.runs.disagg_eagle import E2eOptions, E2eResult
from kvalign.live.wire.metrics import parse_metrics, spec_window
from kvalign.live.runs.scenario import RequestRecord


def _metrics(verify: int, gen: int, done: int, accept: float | None) -> str:
    text = (
        "# TYPE sglang:spec_verify_calls_total counter\n"
        f'sglang:spec_verify_calls_total{{worker_id="1f"}} {verify}\n'
        "# TYPE sglang:generation_tokens_total counter\n"
        f'sglang:generation_tokens_total{{worker_id="1f",is_streaming="true"}} {gen}\n'
        "# TYPE sglang:num_requests_total counter\n"
        f'sglang:num_requests_total{{worker_id="1f",is_streaming="true"}} {done}\n'
    )
    if accept is not None:
        text += f'# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length{{worker_id="1f"}} {accept}\n'
    return text


def _record(i: int, n_tokens: int, hit: float, xfer: float | None) -> RequestRecord:
    timing = {"ttft_ms": 5.0, "total_time_ms": 9.0, "kv_hit_rate": hit}
    if xfer is not None:
        timing["kv_transfer_estimated_latency_ms"] = xfer
    res = ChatResult(prefill_worker_id=7, decode_worker_id=9, timing=timing, done=True)
    return RequestRecord(i, list(range(n_tokens)), True, {7: i}, res, 16)


def test_report_shows_per_request_spec_columns_and_the_window():
    before = parse_metrics(_metrics(0, 0, 0, None))
    snaps = [parse_metrics(_metrics(3, 10, 1, 3.0)), parse_metrics(_metrics(6, 20, 2, 2.0))]
    per_request = [spec_window(before, snaps[:1]), spec_window(snaps[0], snaps[1:])]
    res = E2eResult([_record(0, 21, 0.0, 0.0), _record(1, 39, 1 / 3, None)], spec_window(before, snaps), per_request)
    lines = res.report().splitlines()
    assert lines[0].endswith("Δgen Δverify accept_len kv_xfer_ms")
    assert lines[1].split()[-4:] == ["10", "3", "3.000", "0"]
    assert lines[2].split()[-4:] == ["10", "3", "2.000", "absent"]
    assert ("decode window: Δverify 6, Δgeneration_tokens 20, Δfinished 2; spec_accept_length 2.500 "
            "(readings [3.0, 2.0]); (Δgen − Δfinished)/Δverify 3.000; naive Δgen/Δverify 3.333 "
            "(not asserted: counts each prefill hand-off token)") in lines
    assert lines[-1] == "PASS: all assertions hold"
    res.failures.append("assertion 3 (x): y")
    assert res.report().splitlines()[-1] == "FAIL assertion 3 (x): y" and not res.passed


def test_options_describe_and_validate():
    assert E2eOptions().gpus_needed == 2 and E2eOptions(single_gpu=True).gpus_needed == 1
    assert E2eOptions(engine="fake-cpu").gpus_needed == 0 == E2eOptions(engine="sglang-cpu").gpus_needed
    assert not E2eOptions(engine="fake-cpu").speculates and E2eOptions(engine="sglang-cpu").speculates
    assert "[NEGATIVE CONTROL: the draft never agrees with the target]" in E2eOptions(
        engine="sglang-cpu", draft="disagree").describe()
    with pytest.raises(ValueError, match="needs --engine sglang-cpu or sglang-gpu"):
        E2eOptions(engine="fake-cpu", draft="disagree")
    with pytest.raises(ValueError, match="kvalign's tiny models"):  # a downloaded model has no disagreeing twin
        E2eOptions(model="Qwen/Qwen3-8B", draft="disagree")
    assert "disagreeing draft" in E2eOptions(draft="disagree").describe()  # the tiny pair on the GPU engine
    with pytest.raises(ValueError, match="engine must be one of"):
        E2eOptions(engine="tpu")
    assert "[NEGATIVE CONTROL: router eagle forced off]" in E2eOptions(router_eagle=False).describe()
    topo = E2eOptions(router_eagle=False).topology()
    assert [(w.role, w.gpu, w.register_eagle) for w in topo.workers] == [
        ("prefill", 0, False), ("prefill", 0, False), ("decode", 1, False)]
    with pytest.raises(ValueError, match="max-tokens"):
        E2eOptions(max_tokens=1)
