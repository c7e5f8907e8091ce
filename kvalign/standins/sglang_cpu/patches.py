"""The narrow patches that let SGLang (each release in ``SUPPORTED``) run EAGLE3 and prefill/decode
disaggregation on CPU.

Applied by this package's ``sitecustomize`` in real-engine worker processes only (never in
kvalign's oracles). Each patch names the SGLang code it changes and first checks that the code
in the running release still looks as the patch expects (the same in 0.5.21 and 0.5.23, checked
at every start), so a changed SGLang fails at start-up with the reason instead of running
half-patched.

EAGLE on the ``torch_native`` attention backend (the only backend that runs on CPU without the
CPU build of sgl-kernel):

* :func:`draft_extend_backend` — ``DraftBackendFactory`` knows no ``torch_native`` draft-extend
  backend ("EAGLE is not supported in attention backend torch_native"); the draft gets its own
  ``TorchNativeAttnBackend``. With ``--speculative-num-steps 1`` no multi-step draft-decode
  backend is built, so nothing else is needed (num-steps >= 2 stays unsupported on CPU).
* :func:`target_verify_extend` — ``TorchNativeAttnBackend.forward_extend`` reads
  ``extend_prefix_lens``, which a TARGET_VERIFY batch does not carry. As SGLang's triton backend
  does for a verify batch, the prefix is ``seq_lens`` and each request extends by its
  ``num_draft_tokens`` draft tokens (a chain: ``--speculative-eagle-topk 1``), attended causally.

Prefill/decode disaggregation with the ``fake`` transfer backend (moves no KV bytes: the decode
half's negative control; the real transfer is SGLang's NIXL backend, :mod:`.kv_transfer`):

* :func:`fake_transfer_prefill_check` — ``handle_pd_disaggregation`` rejects ``fake`` on prefill;
  that one check is skipped. :func:`fake_transfer_bootstrap` — ``fake`` has no bootstrap server
  class, and a prefill starts one: it gets a no-op.
* :func:`fake_transfer_decode` — decode takes the fake path only for requests whose bootstrap
  host is ``None`` or ``2.2.2.2``, but Dynamo sends the prefill's real host; with ``fake``
  configured, every request takes the fake path.

The paged KV allocator on a release without its CPU path (0.5.21):

* :func:`paged_allocator_on_cpu` — ``alloc_extend`` / ``alloc_decode`` launch Triton kernels
  unconditionally; they get :mod:`.allocator`'s CPU launches instead.

KV events on a release whose config has no ``bind`` (before 0.5.23):

* :func:`kv_events_local_publish` — the publisher connects to a concrete host, and so does
  Dynamo's relay: nothing would listen. When the harness sets ``KVALIGN_KV_EVENTS_IPC``, the
  publisher gets that ``ipc://`` endpoint instead, which SGLang's own socket set-up binds; the
  harness's loopback forwarder connects there and binds the relay's 127.0.0.1 address.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

PREFILL_FAKE_ASSERT = "Prefill server does not support 'fake' as the transfer backend"


class StandinMismatch(RuntimeError):
    """The SGLang code a patch targets is not what the patch was written for."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        from importlib import metadata

        from kvalign.standins.sglang_cpu import SUPPORTED

        raise StandinMismatch(f"kvalign SGLang CPU stand-in: {what} (sglang {metadata.version('sglang')}; written for "
                              f"{', '.join(SUPPORTED)})")


def draft_extend_backend() -> None:
    """Give the EAGLE draft a ``TorchNativeAttnBackend`` for draft-extend."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.speculative import draft_utils

    factory = draft_utils.DraftBackendFactory
    original = factory._create_backend
    _require(list(inspect.signature(original).parameters) ==
             ["self", "backend_name", "backend_map", "error_template", "stamps_children"],
             "DraftBackendFactory._create_backend changed its signature")

    @functools.wraps(original)
    def _create_backend(self: Any, backend_name: str, backend_map: dict, error_template: str,
                        stamps_children: bool = False) -> Any:
        if not stamps_children and "torch_native" not in backend_map:  # draft-extend, not multi-step decode
            backend_map = {**backend_map,
                           "torch_native": lambda: ("torch_native", TorchNativeAttnBackend(self.draft_model_runner))}
        return original(self, backend_name, backend_map, error_template, stamps_children)

    factory._create_backend = _create_backend


def target_verify_extend() -> None:
    """``TorchNativeAttnBackend.forward_extend`` for TARGET_VERIFY batches (topk 1 chains)."""
    from sglang.srt.layers.attention import torch_native_backend as tnb
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    backend = tnb.TorchNativeAttnBackend
    original = backend.forward_extend
    _require("extend_prefix_lens" in inspect.getsource(original) and hasattr(backend, "_run_sdpa_forward_extend"),
             "TorchNativeAttnBackend.forward_extend no longer reads extend_prefix_lens")

    @functools.wraps(original)
    def forward_extend(self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool = True) -> Any:
        if not forward_batch.forward_mode.is_target_verify():
            return original(self, q, k, v, layer, forward_batch, save_kv_cache)
        import torch

        prefix = forward_batch.seq_lens
        bs = prefix.shape[0]
        per_req = q.shape[0] // bs
        _require(per_req * bs == q.shape[0], f"verify batch of {q.shape[0]} tokens is not {bs} equal chains")
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
        extend = torch.full_like(prefix, per_req)
        self._run_sdpa_forward_extend(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, prefix + extend, prefix, extend,
            None, scaling=layer.scaling, enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num, causal=True,
        )
        return o

    backend.forward_extend = forward_extend


class NoBootstrapServer:
    """The prefill's KV bootstrap server under ``fake``: nothing to bootstrap, no socket."""

    def __init__(self, host: str, port: int, **_: Any) -> None:
        self.host, self.port = host, port

    def close(self) -> None:
        """Nothing was opened."""


def cpu_graph_seq_len_fill() -> None:
    """``TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value``, for DP attention on this CPU.

    Under DP attention every forward pads its batch for the MLP sync (``prepare_mlp_sync_batch`` ->
    ``_pad_inputs_to_size``), which on CPU asks the attention backend for the padded sequences'
    length; only SGLang's CPU backend that needs the CPU build of sgl-kernel (``intel_amx``,
    ``intel_amx_backend.py``: 1) defines it, so torch_native raised ``AttributeError`` at the first
    request (seen live). The value is intel_amx's (tests hold it to that method). Nothing changes
    where the backend has one."""
    from sglang.srt.layers.attention import torch_native_backend as tnb

    if not hasattr(tnb.TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):
        tnb.TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: CPU_GRAPH_SEQ_LEN_FILL


#: What SGLang's own CPU attention backend pads a sequence with (``IntelAMXAttnBackend``, 0.5.19 to 0.5.23).
CPU_GRAPH_SEQ_LEN_FILL = 1


def rotary_empty_batch() -> None:
    """``RotaryEmbedding.forward_native`` on a batch of no tokens returns it unrotated.

    Under DP attention a rank without requests still runs an idle forward for the collective MLP
    step, with zero tokens; SGLang's native rotary path reshapes ``query.view(0, -1, head_size)``,
    which torch refuses ("cannot reshape tensor of 0 elements ... -1 ... ambiguous", seen live), while
    the GPU path's kernel rotates nothing. Batches with tokens go to SGLang's own code unchanged."""
    from sglang.srt.layers.rotary_embedding import base

    original = base.RotaryEmbedding.forward_native
    _require("query.view(num_tokens, -1, self.head_size)" in inspect.getsource(original),
             "RotaryEmbedding.forward_native no longer reshapes query by num_tokens")

    @functools.wraps(original)
    def forward_native(self: Any, positions: Any, query: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
        if positions.numel() == 0:
            return query, key
        return original(self, positions, query, key, *args, **kwargs)

    base.RotaryEmbedding.forward_native = forward_native


def fake_transfer_prefill_check() -> None:
    """Let ``handle_pd_disaggregation`` accept ``fake`` on a prefill worker."""
    from sglang.srt.arg_groups import pd_disaggregation_hook as hook

    original = hook.handle_pd_disaggregation
    _require(PREFILL_FAKE_ASSERT in inspect.getsource(original),
             "handle_pd_disaggregation no longer rejects 'fake' on prefill as patched")

    @functools.wraps(original)
    def handle_pd_disaggregation(server_args: Any) -> None:
        try:
            original(server_args)
        except AssertionError as exc:  # the prefill branch's last check; nothing after it applies to fake
            if str(exc) != PREFILL_FAKE_ASSERT:
                raise

    hook.handle_pd_disaggregation = handle_pd_disaggregation


def fake_transfer_bootstrap() -> None:
    """A prefill under ``fake`` starts :class:`NoBootstrapServer` (SGLang has none for it)."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.managers import disagg_service

    original = disagg_service.get_kv_class
    _require(original(TransferBackend.FAKE, KVClassType.BOOTSTRAP_SERVER) is None,
             "the fake transfer backend now has a bootstrap server")

    @functools.wraps(original)
    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        if transfer_backend == TransferBackend.FAKE and class_type == KVClassType.BOOTSTRAP_SERVER:
            return NoBootstrapServer
        return original(transfer_backend, class_type)

    disagg_service.get_kv_class = get_kv_class


def fake_transfer_decode() -> None:
    """With ``fake`` configured, every decode request takes SGLang's fake-transfer path."""
    from sglang.srt.disaggregation import decode, utils

    original = utils._is_fake_transfer
    _require(decode._is_fake_transfer is original, "decode no longer imports utils._is_fake_transfer")

    @functools.wraps(original)
    def _is_fake_transfer(req: Any) -> bool:
        from sglang.srt.runtime_context import get_disagg

        return get_disagg().disaggregation_transfer_backend == "fake" or original(req)

    utils._is_fake_transfer = decode._is_fake_transfer = _is_fake_transfer




def kv_events_local_publish() -> None:
    """Bind SGLang's KV-event PUB on the harness's IPC endpoint (releases without ``bind`` only)."""
    import os

    from sglang.srt.disaggregation import kv_events

    from kvalign.standins.sglang_cpu import KV_EVENTS_IPC_ENV

    endpoint = os.environ.get(KV_EVENTS_IPC_ENV)
    if not endpoint:
        return
    _require("bind" not in kv_events.KVEventsConfig.model_fields,
             "KVEventsConfig has 'bind': the publisher can bind 127.0.0.1 itself, no forwarder is needed")
    _require(endpoint.startswith("ipc://"), f"{KV_EVENTS_IPC_ENV} must be an ipc:// endpoint, got {endpoint!r}")
    publisher = kv_events.ZmqEventPublisher
    original = publisher.__init__
    _require("endpoint" in inspect.signature(original).parameters and
             'self._endpoint.startswith("ipc://")' in inspect.getsource(publisher._socket_setup),
             "ZmqEventPublisher no longer takes endpoint= or no longer binds ipc:// endpoints")

    @functools.wraps(original)
    def __init__(self: Any, attn_dp_rank: int, endpoint: str = "", **kwargs: Any) -> None:
        _require(attn_dp_rank == 0, f"KV events from attention DP rank {attn_dp_rank}: the forwarder serves rank 0 only")
        original(self, attn_dp_rank, endpoint=local, **kwargs)

    local = endpoint
    publisher.__init__ = __init__


def paged_allocator_on_cpu() -> None:
    """Rebind the paged allocator's two Triton launches to CPU code (releases without a CPU path)."""
    from sglang.srt.mem_cache.allocator import paged

    from kvalign.standins.sglang_cpu.allocator import Launch, alloc_decode_cpu, alloc_extend_launch

    allocator = paged.PagedTokenToKVPoolAllocator
    extend, decode = inspect.getsource(allocator.alloc_extend), inspect.getsource(allocator.alloc_decode)
    _require("alloc_extend_kernel[" in extend and "use_triton_kernels" not in extend and
             "alloc_decode_kernel[" in decode and "use_triton_kernels" not in decode,
             "PagedTokenToKVPoolAllocator no longer launches its Triton kernels unconditionally")
    naive = getattr(paged, "alloc_extend_naive", None)
    _require(naive is not None and list(inspect.signature(naive).parameters) ==
             ["prefix_lens", "seq_lens", "last_loc", "free_pages", "out_indices", "page_size", "device"],
             "alloc_extend_naive is missing or changed its signature")
    paged.alloc_extend_kernel = Launch(alloc_extend_launch(naive), "alloc_extend_kernel")
    paged.alloc_decode_kernel = Launch(alloc_decode_cpu, "alloc_decode_kernel")
