"""Dynamo's binding and SGLang's cache classes, imported once for every ``check --jobs`` worker.

The fork server of :mod:`kvalign.verify.runner.pool` imports this module (``set_forkserver_preload``) before
it forks the workers, so the seconds of CPU SGLang's import takes are spent once, not once per worker,
and the workers share those pages (:func:`gc.freeze`: the collector leaves them alone). A failure
here is left for the worker to meet and report.
"""

from __future__ import annotations

import gc

try:
    from kvalign.oracles.dynamo import load_router_hasher
    from kvalign.oracles.sglang import SglangRadixCache

    load_router_hasher(None)
    SglangRadixCache(1, eagle=False)
except Exception:  # noqa: BLE001 - the worker imports again and says what failed, in one line
    pass
# Everything imported so far lives as long as the workers do: out of the collector's sight, a full
# collection in a worker (Hypothesis runs one when it first seeds its random state) does not walk
# SGLang's and torch's objects, nor write to the pages the workers share with this process.
gc.freeze()
