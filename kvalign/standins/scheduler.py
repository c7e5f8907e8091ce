"""Stand-in for the two things an SGLang scheduler process has that kvalign's in-process scheduler lacks: a model.

SGLang's admission path (``Req.init_next_round_input``, ``PrefillAdder.add_one_req``,
``ScheduleBatch.prepare_for_extend``, ``release_kv_cache``) runs on CPU as it is, with SGLang's real
allocators and pools. It reads two things that a server builds from its model:

* the published server config (``runtime_context.get_exec()`` / ``get_schedule()`` / ``get_memory()``
  ...). :func:`scheduler_context` builds it from a real :class:`ServerArgs` with the flags a server
  with HiCache on is started with (``--page-size P --enable-hierarchical-cache
  --hicache-write-policy POLICY``), projected into config bags by SGLang's own
  ``RuntimeContext.set_server_args``. What is left out is ``ServerArgs.resolve_once``, which loads the
  model's HuggingFace config (there is no model here): the bags hold the flags' values and SGLang's
  defaults, not what resolution would derive from a model and a GPU.
* ``ScheduleBatch.model_config``: :data:`MODEL_CONFIG` answers the two fields that
  ``ScheduleBatch.init_new`` / ``prepare_for_extend`` read for a text-only decoder (``vocab_size``,
  ``is_encoder_decoder``); any other read raises ``AttributeError`` rather than being guessed.

Pinned to :data:`kvalign.standins.hicache.SUPPORTED` (SGLang 0.5.23) with the host-tier stand-in it
serves; ``tests/unit/standins/test_scheduler_standin.py`` holds it to the original.
"""

from __future__ import annotations

import types
from functools import cache
from typing import Any

#: ``ScheduleBatch.model_config`` for a text-only decoder: the only fields the admission path reads.
MODEL_CONFIG = types.SimpleNamespace(vocab_size=1 << 20, is_encoder_decoder=False)


@cache
def scheduler_context(page_size: int, write_policy: str) -> Any:
    """SGLang's own ``RuntimeContext`` for a scheduler started with HiCache on, without a model (one per
    page size and write policy: the admission path only reads it).

    Activate it with ``sglang.srt.runtime_context.use_context`` around SGLang calls (it swaps a process
    global, so only for the duration of a call)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="kvalign/no-model", device="cpu", page_size=page_size,
                      enable_hierarchical_cache=True, hicache_write_policy=write_policy)
    context = runtime_context.RuntimeContext(parallel=runtime_context.ParallelContext())
    context.set_server_args(args)
    return context
