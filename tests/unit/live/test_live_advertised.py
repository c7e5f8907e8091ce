"""The live advertised row and the CPU workers' event format: commands, the recording hook, the row logic.

The rows themselves are measured on real workers by ``tests/e2e/test_fuzz.py`` (``e2e fuzz`` reports
``advertised`` at the end of every run); here: what the workers are started with, that the hook writes
SGLang's own descriptor from a resolved engine configuration, and how a row is judged.
"""

from __future__ import annotations

import json
import types

import pytest

from kvalign.live.cluster.topology import Topology
from kvalign.live.engines.sglang_cpu import plan_cluster, server_info_path
from kvalign.live.engines.sglang_worker import SERVER_INFO_ENV
from kvalign.live.runs.advertised import advertised_rows
from kvalign.model.events import BlockStored, EventBatch


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_dynamo_format_and_recording_reach_the_publishing_workers_only(tmp_path):
    plan, kind = plan_cluster(Topology.disaggregated(1, 1, eagle=True), tmp_path)
    kind.event_format, kind.record_server_info = "dynamo", True
    specs = {w.name: kind.command(w, plan) for w in plan.topology.workers}
    prefill, decode = specs["prefill0"], specs["decode0"]
    assert json.loads(_flag(prefill.argv, "--kv-events-config"))["format"] == "dynamo"
    assert prefill.argv[1:3] == ["-m", "kvalign.live.engines.sglang_worker"]
    assert prefill.env[SERVER_INFO_ENV] == str(server_info_path(plan, plan.topology.workers[0]))
    assert "--kv-events-config" not in decode.argv and SERVER_INFO_ENV not in decode.env
    assert decode.argv[1:3] == ["-m", "dynamo.sglang"]
    plan, kind = plan_cluster(Topology.aggregated(1, eagle=True), tmp_path / "b")  # the default: untouched
    argv = kind.command(plan.topology.workers[0], plan).argv
    assert "format" not in json.loads(_flag(argv, "--kv-events-config")) and argv[1:3] == ["-m", "dynamo.sglang"]


def test_the_hook_writes_sglangs_descriptor_of_the_engine_arguments(tmp_path, monkeypatch):
    """``record_server_info`` wraps Dynamo's ``Config.use_resolved_server_args``: handed a resolved engine
    configuration (FlashMLA at --page-size 16: SGLang runs it at 64), it writes SGLang's own descriptor and
    still returns what Dynamo's method returns."""
    try:
        from kvalign.oracles.page_overrides import WorkerConfig, platform, resolve
        from kvalign.oracles.sglang import _modules

        _modules()  # SGLang's import chain behind the torchvision shim, before dynamo.sglang imports it
        import dynamo.sglang.args as args_mod
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"dynamo.sglang unavailable: {exc}")
    from kvalign.live.engines.sglang_worker import record_server_info

    monkeypatch.setattr(args_mod.Config, "use_resolved_server_args", args_mod.Config.use_resolved_server_args)
    out = tmp_path / "info.json"
    record_server_info(str(out))
    config = WorkerConfig(page_size=16, backend="flashmla", model="mla")
    server_args = resolve(config)
    with platform(config.platform):
        dyn = args_mod.Config(server_args, types.SimpleNamespace())
        view = args_mod.Config.use_resolved_server_args(dyn, server_args)
    info = json.loads(out.read_text())
    assert info["page_size"] == 64 and info["kv_events"]["block_size"] == 64 and view.page_size == 64


class _Capture:
    def __init__(self, sizes: dict[str, list[int]]) -> None:
        self.items = [types.SimpleNamespace(label=label, batch=EventBatch(0.0, [
            BlockStored([i], None, [0] * size, size) for i, size in enumerate(s)], 0, "map"))
            for label, s in sizes.items()]

    def snapshot(self):
        return self.items


def _cluster(tmp_path, card_block: int, advertised: int | None, emitted: list[int]):
    plan, _kind = plan_cluster(Topology.aggregated(1, eagle=False, page_size=8), tmp_path)
    spec = plan.topology.workers[0]
    bucket = plan.discovery_store / "v1" / "mdc"
    bucket.mkdir(parents=True, exist_ok=True)
    (bucket / "card").write_text(json.dumps({"instance_id": 7, "card_json": {"kv_cache_block_size": card_block}}))
    if advertised is not None:
        server_info_path(plan, spec).write_text(json.dumps({"kv_events": {"block_size": advertised}, "page_size": 8}))
    handle = types.SimpleNamespace(spec=spec, instance_id=7)
    return types.SimpleNamespace(plan=plan, workers={spec.name: handle}, capture=_Capture({spec.name: emitted}))


@pytest.mark.parametrize("card, advertised, emitted, cause", [
    (8, 8, [8], None),
    (16, 8, [8], "REGISTERED_BLOCK_SIZE"),
    (8, 16, [8], "ADVERTISED_BLOCK_SIZE"),
    (8, 8, [8, 16], "REGISTERED_BLOCK_SIZE"),
    (8, 8, [], None),
    (8, None, [8], "UNAVAILABLE"),
])
def test_a_row_fails_only_when_the_three_disagree(tmp_path, card, advertised, emitted, cause):
    (row,) = advertised_rows(_cluster(tmp_path, card, advertised, emitted))
    assert row.cause == cause and row.ok == (cause is None) and row.checked == bool(emitted)
    assert row.launch_page_size == 8 and f"kv_cache_block_size {card}" in row.detail
