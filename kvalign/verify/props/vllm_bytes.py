"""vLLM's opt-in block-hash encoding behind Dynamo's KV router (``check --engine vllm --all``): the ``hashes bytes`` row.

vLLM publishes a block's hash as a 64-bit int unless a user sets ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``
(``vllm/envs.py``); with it, Dynamo 1.6.1's relay indexes none of vLLM's blocks, silently
(:attr:`~kvalign.model.causes.Cause.VLLM_BYTES_HASHES_DROPPED`). A verdict that counted that row by default read
``misaligned`` for every Dynamo x vLLM pair on a setting few deployments run, so it is a property of its own with
that setting as its surface, off by default as SGLang's ``mm``, ``hybrid`` and ``storage`` are:
``check --engine vllm`` is a verdict on workers with int hashes and names this one as not run
(:mod:`kvalign.verify.engine.scope`); ``--all`` runs it. Its row is :func:`~kvalign.verify.props.vllm.encodings.bytes_rows`;
the ``hashes int`` row's negative control (int hashes re-encoded as those bytes on the hop) stays in the default
property and is its mechanism. Importing this module imports neither vLLM, Dynamo nor SGLang.
"""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import Options, SetUpOnceProperty
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.props.vllm import BUDGET

#: the deployments this property's row speaks for (a default verdict is for deployments without them)
SURFACE = "vLLM workers with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0"


def _rows(systems: Any, modes: tuple[str, ...], opts: Options) -> list[RowResult]:
    from kvalign.verify.props.vllm.encodings import bytes_rows
    from kvalign.verify.props.vllm.running import BLOCK_SIZE, NUM_BLOCKS

    return bytes_rows(systems.router_path(), opts.examples_for(BUDGET), opts.seed, opts.page_size or BLOCK_SIZE,
                      NUM_BLOCKS)


PROPERTY = SetUpOnceProperty("vllm_bytes", modes=("plain",), default=False, surface=SURFACE, engine="vllm",
                             events="own", budget=BUDGET, cost=20.0, rows=_rows, variants=())
