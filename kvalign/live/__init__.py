"""Live layer: the real Dynamo frontend + KV router in front of real worker processes.

One harness for CPU CI and the GPU nightly, in four layers that import downwards only (the
``live`` contract in ``pyproject.toml``, checked by ``lint-imports``), top to bottom:

* :mod:`.runs` — what runs on a cluster: the seed scenario, the EAGLE3 prefill/decode run, the fuzz;
* :mod:`.engines` — the kinds of worker (fake CPU, real SGLang on CPU, real SGLang on GPU) and the
  tiny offline models they serve;
* :mod:`.cluster` — the processes' lifecycle: topology (roles, ports, env), launch, readiness,
  restart, teardown, discovery, the control endpoints, the model directory the frontend reads;
* :mod:`.wire` — what crosses a process boundary: KV-event captures, the lossy hop, the HTTP
  client (``nvext``), Prometheus metrics.

The live layer sits above verification and streams: it may import any other layer of kvalign
but the commands.
"""
