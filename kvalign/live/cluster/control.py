"""Flush a live worker's KV cache through Dynamo's own ``clear_kv_blocks`` endpoint.

``dynamo.sglang`` serves ``<namespace>.<component>.clear_kv_blocks`` on every worker (1.6.1,
``init_llm.py``): it calls SGLang's ``flush_cache`` when no request is active, and SGLang then
publishes ``AllBlocksCleared``. The call goes over Dynamo's request plane to one instance id, so
it runs in a short-lived child process (``python -m kvalign.live.cluster.control``) with the run's
control-plane environment: the driver never hosts a Dynamo runtime, and the runtime's log lines
go to the run's ``logs/control.log``, not the terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Sequence

from kvalign.live.cluster.topology import ClusterPlan

CLEAR_TIMEOUT_S = 60.0


class ControlError(RuntimeError):
    """A worker did not confirm the flush."""


def clear_kv_blocks(plan: ClusterPlan, component: str, instance_ids: Sequence[int]) -> None:
    """Flush each instance's cache; raises :class:`ControlError` naming the first that refused."""
    log = plan.run_dir / "logs" / "control.log"
    cmd = [plan.python, "-m", "kvalign.live.cluster.control", "--namespace", plan.namespace, "--component", component,
           *map(str, instance_ids)]
    with open(log, "ab") as err:
        try:
            proc = subprocess.run(cmd, env={**os.environ, **plan.plane_env(), "DYN_LOG": "warn"}, stdout=subprocess.PIPE,
                                  stderr=err, timeout=CLEAR_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise ControlError(f"clear_kv_blocks did not answer within {CLEAR_TIMEOUT_S:.0f}s (log {log})") from None
    try:
        results = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ControlError(f"clear_kv_blocks exited {proc.returncode} without a result (log {log})") from None
    bad = {iid: r for iid, r in results.items() if r.get("status") != "success"}
    if bad:
        raise ControlError(f"clear_kv_blocks failed: {json.dumps(bad)[:300]}")


async def _clear(namespace: str, component: str, instance_ids: list[int]) -> dict[str, dict]:
    from dynamo.runtime import DistributedRuntime

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    try:
        client = await runtime.endpoint(f"{namespace}.{component}.clear_kv_blocks").client()
        await asyncio.wait_for(client.wait_for_instances(), CLEAR_TIMEOUT_S)
        out: dict[str, dict] = {}
        for iid in instance_ids:
            last: dict = {"status": "error", "message": "no answer"}
            async for chunk in await client.direct({}, iid):
                data = chunk.data() if hasattr(chunk, "data") else chunk
                if isinstance(data, dict):
                    last = data
            out[str(iid)] = last
        return out
    finally:
        runtime.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvalign.live.cluster.control", description="flush live workers' KV caches")
    p.add_argument("--namespace", required=True)
    p.add_argument("--component", required=True)
    p.add_argument("instance_ids", nargs="+", type=int)
    args = p.parse_args(argv)
    results = asyncio.run(_clear(args.namespace, args.component, args.instance_ids))
    print(json.dumps(results), flush=True)
    return 0 if all(r.get("status") == "success" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
