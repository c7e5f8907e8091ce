"""Live: the real SGLang server on CPU with HiCache's ``file`` storage tier refills a prompt from storage.

SGLang's own server (``python -m sglang.launch_server``, the tiny Llama of
:mod:`kvalign.live.engines.engine_model`, the CPU stand-ins of :mod:`kvalign.standins.sglang_cpu`
and :mod:`kvalign.standins.hicache_cpu`, ``storage_scratch_on_cpu`` included) with
``--enable-hierarchical-cache --hicache-storage-backend file``. A prompt is cached, then pushed out
of device and host by other prompts (its pages are written to storage on the way), then asked for
again: SGLang reports the reuse as ``storage`` in ``cached_tokens_details``, and its KV events store
the refilled pages on the host tier (``CPU_PINNED``) after their host removal, while no event ever
named a storage medium: what the ``storage`` property's ``STORAGE_TIER_UNCREDITED`` says, on the
real engine. Without the scratch-page stand-in the refill fails ("pin_memory=True requires a CUDA or
other accelerator backend") and the reuse is 0. SGLang's server alone; through Dynamo's router, the same
refill is ``e2e fuzz --hicache --storage file`` (``test_fuzz_storage.py``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import requests
import zmq

from conftest import OUT_ROOT, sglang_cpu_missing

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
PAGE, PROMPT_WORDS, PRESSURE = 4, 40, 45


def _generate(port: int, text: str) -> dict:
    r = requests.post(f"http://127.0.0.1:{port}/generate", timeout=120,
                      json={"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    r.raise_for_status()
    return r.json()["meta_info"]


@pytest.mark.nightly
@pytest.mark.skipif(not os.environ.get("KVALIGN_NIGHTLY"), reason=(
    "SGLang's own server alone, a real-engine start CI pays for once already: nightly only (KVALIGN_NIGHTLY=1); "
    "CI holds the same refill on the real engine behind Dynamo in tests/e2e/test_fuzz_storage.py (storage tokens "
    "reused, none credited at routing) and the events of SGLang's own storage code in check --property storage"))
def test_real_engine_refills_from_file_storage(tmp_path: Path) -> None:
    missing = sglang_cpu_missing()
    if missing:
        pytest.skip(f"real SGLang engine cannot run on this CPU: {missing}")
    from kvalign.live.cluster.model_dir import vocab
    from kvalign.live.cluster.ports import PortPool
    from kvalign.live.engines.engine_model import write_target
    from kvalign.oracles.sglang import torch_extensions_dir
    from kvalign.standins.sglang_cpu import worker_env

    model = write_target(tmp_path / "model")
    ports = PortPool()
    port, events_port = ports.take("http"), ports.take("kv-events")
    storage = tmp_path / "l3"
    config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}", "topic": "", "bind": True})
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
            "--attention-backend", "torch_native", "--disable-cuda-graph", "--disable-overlap-schedule",
            "--page-size", str(PAGE), "--max-total-tokens", "512", "--host", "127.0.0.1", "--port", str(port),
            "--enable-cache-report", "--skip-server-warmup", "--kv-events-config", config,
            "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": PAGE})]
    env = {**os.environ, **worker_env(), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TORCH_EXTENSIONS_DIR": torch_extensions_dir(), "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)}
    OUT_ROOT.mkdir(parents=True, exist_ok=True)
    log_path = OUT_ROOT / f"real-engine-storage-{os.getpid()}.log"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{events_port}")
    events: list = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the server exited ({proc.returncode}); log: {log_path}"
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        else:
            pytest.fail(f"the server did not come up in 300 s; log: {log_path}")
        rnd = random.Random(0)
        words = list(vocab("ok"))[8:]
        prompt = " ".join(rnd.choice(words) for _ in range(PROMPT_WORDS))
        first = _generate(port, prompt)
        for _ in range(PRESSURE):  # other prompts: the first one's pages go device -> host -> out (and to storage)
            _generate(port, " ".join(rnd.choice(words) for _ in range(PROMPT_WORDS)))
        again = _generate(port, prompt)
        time.sleep(0.5)
        while sub.poll(100):
            events.extend(msgpack.unpackb(sub.recv_multipart()[-1], raw=False, strict_map_key=False)[1])
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        sub.close()
        ctx.term()
    assert first["cached_tokens"] == 0
    details = again.get("cached_tokens_details") or {}
    assert details.get("storage", 0) >= PROMPT_WORDS - PAGE, f"no refill from storage: {again}; log: {log_path}"
    assert any(storage.iterdir()), "the file backend wrote no page"
    assert not {"DISK", "EXTERNAL"} & {ev.get("medium") for ev in events}, "SGLang published a storage-tier medium"
    removed_from_host: set[int] = set()
    refilled: set[int] = set()
    for ev in events:
        if ev.get("medium") != "CPU_PINNED":
            continue
        hashes = {int(h) for h in ev.get("block_hashes") or ()}
        if ev.get("type") == "BlockRemoved":
            removed_from_host |= hashes
        elif str(ev.get("type", "")).startswith("BlockStored"):
            refilled |= hashes & removed_from_host
    assert refilled, f"no host store of a page after its host removal among {len(events)} events"
