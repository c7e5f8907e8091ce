"""Live layer: the real Dynamo frontend + KV router in front of real worker processes.

One harness for CPU CI and the GPU nightly: :mod:`topology` (roles, ports, env, worker kinds),
:mod:`cluster` (launch, readiness, teardown), :mod:`processes`, :mod:`ports`, :mod:`client`
(streaming chat + nvext), :mod:`capture` (live SGLang KV events -> kvalign's prediction),
:mod:`discovery` (file-backed discovery store), :mod:`scenario` (shared requests + assertions).
"""
