"""``kvalign e2e fuzz``: generated live workloads held against the real router and engine.

The unit layer's method — generated cases, invariants, shrinking — applied across the process
boundary: a Hypothesis state machine (:mod:`.machine`) drives one live cluster through the real
frontend and KV router with requests drawn from a prefix tree (:mod:`.prompts`), concurrent
bursts, cache flushes, pool-filling evictions, a batch lost on a loopback hop and worker
restarts (:mod:`.rules`, run by :mod:`.driver`), and after every step checks each request three
ways: the router's ``kv_hit_rate``, kvalign's prediction from the captured events (:mod:`.views`)
and the engine's own ``cached_tokens`` (:mod:`.invariants`, :mod:`.judging`). A failure is shrunk
and written as a replayable script (:mod:`.script`).

Where to start reading: :mod:`.options` (what a run takes), :mod:`.plan` (the cluster those options
start, planned in one place), :mod:`.driver` (a step at a time) and its parts :mod:`.settling`,
:mod:`.observing`, :mod:`.judging`, :mod:`.rules`.
"""
