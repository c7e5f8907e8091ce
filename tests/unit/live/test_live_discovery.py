"""Reading the file discovery store, fed by the real Dynamo runtime's own registration."""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from kvalign.live.cluster import discovery
from kvalign.live.cluster.model_dir import write_model_dir
from kvalign.live.cluster.ports import PortPool


def _register_and_read(tmp: str) -> None:
    """In a fresh process: the Dynamo runtime is one per process (a second ``DistributedRuntime``
    reuses the first's TCP server and discovery store), and other tests (the check rows' ingest
    path) start one in the test process first."""
    import os
    from pathlib import Path

    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    enable_eagle = True
    kv = Path(tmp) / "kv"
    rpc = PortPool().take("rpc")
    os.environ.update({"DYN_FILE_KV": str(kv), "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RPC_PORT": str(rpc),
                       "DYN_EVENT_PLANE_HOST": "127.0.0.1"})
    model = write_model_dir(Path(tmp) / "model")

    async def register() -> int:
        rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
        ep = rt.endpoint("ns1.backend.generate")
        rc = ModelRuntimeConfig()
        rc.enable_eagle = enable_eagle
        serving = asyncio.ensure_future(ep.serve_endpoint(lambda req, ctx=None: iter(()), graceful_shutdown=False))
        await register_model(ModelInput.Tokens, ModelType.Chat, ep, str(model), "tiny", kv_cache_block_size=16,
                             runtime_config=rc, worker_type=WorkerType.Aggregated)
        for _ in range(600):  # 30 s at most: registration is one file write, but a loaded 2-core box is slow
            if discovery.instance_on_port(kv, rpc):
                break
            await asyncio.sleep(0.05)
        iid = ep.connection_id()
        inst = discovery.instance_on_port(kv, rpc)
        card = discovery.card_for(kv, iid)
        serving.cancel()
        rt.shutdown()
        assert inst is not None and inst.instance_id == iid and inst.address == f"127.0.0.1:{rpc}", inst
        assert (inst.namespace, inst.component, inst.endpoint) == ("ns1", "backend", "generate")
        assert card is not None and card.enable_eagle is enable_eagle and card.kv_cache_block_size == 16
        assert card.model_name == "tiny" and card.worker_type == "aggregated"
        assert discovery.instance_on_port(kv, rpc + 1) is None and discovery.card_for(kv, iid + 1) is None
        return iid

    asyncio.run(register())


def test_instance_and_card_as_registered_by_dynamo(tmp_path):
    """The registered-False reading is exercised by the e2e negative control."""
    pytest.importorskip("dynamo.llm", reason="ai-dynamo is not installed: run scripts/setup.sh")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(_register_and_read, str(tmp_path)).result(timeout=120)


def test_empty_or_partial_store_reads_as_nothing(tmp_path):
    assert discovery.instances(tmp_path) == [] and discovery.cards(tmp_path) == []
    d = tmp_path / "v1" / "instances"
    d.mkdir(parents=True)
    (d / "half-written").write_text('{"type": "Endpoint", "instance_')
    assert discovery.instances(tmp_path) == []
