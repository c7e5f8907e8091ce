"""SGLang's real multimodal path on CPU: a Dynamo request in, the token ids SGLang keys pages by out.

An image's KV is keyed in SGLang's radix tree by *pad values*: after its processor expands each
image placeholder into the image's token run, every token of the run is replaced by values derived
from the image's hash. With Dynamo, that hash is the frontend's (``extra_args.mm_hashes``, passed
as ``mm_hashes``) when the engine accepts it, else SGLang's own hash of the pixels. This oracle
runs that path with SGLang's and Dynamo's own code, in the order a ``dynamo.sglang`` worker and
SGLang's server run it:

1. ``dynamo.sglang``: the image URLs from ``multi_modal_data`` (``extract_media_urls``), the
   forwarded hashes (``extract_mm_hashes``) when ``supports_external_mm_hashes(engine)`` says the
   engine takes them; that call also installs Dynamo's own fix-up around SGLang's tokenizer (it
   rebuilds ``padded_input_ids`` after the hashes are applied);
2. SGLang's ``TokenizerManager._tokenize_one_request``: the ``QwenVLImageProcessor`` (HF's
   ``Qwen2VLImageProcessor`` on CPU) expands each placeholder, and the caller's hashes set each
   item's hash and pad values;
3. SGLang's scheduler: ``MultimodalInputs.from_processor_output``, then
   ``Scheduler._try_apply_padded_mm_input_ids`` or the model's ``pad_input_ids``
   (``pad_mm_tokens``), which is what the scheduler stores as ``origin_input_ids`` and keys the
   radix tree with.

What is not SGLang's: the ``TokenizerManager`` is built with only its model-config and
tokenizer/processor initialisers (``init_model_config``, ``init_tokenizer_and_processor``), not
its IPC channels; and its last step, ``_create_tokenized_object`` (packing the result into the
message sent to the scheduler process), is replaced by a function returning the token ids and
the multimodal inputs it was given. The server args are published to SGLang's process context
only while this oracle runs (the previous context is put back after each call), so the other
oracles in the process see what they saw before.
"""

from __future__ import annotations

import asyncio
import types
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvalign.oracles.base import OracleUnavailable


@dataclass(frozen=True)
class MmItem:
    """One image as SGLang keyed it."""

    hash: int | None
    pad_values: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]  # inclusive (start, end) runs in the expanded prompt


@dataclass(frozen=True)
class EngineRequest:
    """What SGLang made of one Dynamo request."""

    input_ids: list[int]  # the expanded prompt, placeholders unpadded
    padded: list[int]  # origin_input_ids: what the radix tree keys pages by
    items: tuple[MmItem, ...]
    forwarded: list[str] | None  # the frontend hashes SGLang was given (None: it hashed the pixels itself)


class _EngineShape:
    """What ``dynamo.sglang._compat.supports_external_mm_hashes`` inspects on an engine: the
    signature of ``sglang.Engine.async_generate`` (SGLang's own function) and the tokenizer
    manager whose ``_tokenize_one_request`` it wraps."""

    def __init__(self, engine_cls: Any, tokenizer_manager: Any):
        self.async_generate = types.MethodType(engine_cls.async_generate, self)
        self.tokenizer_manager = tokenizer_manager


class SglangMultimodal:
    """SGLang's multimodal tokenisation and padding for the model in ``model_dir``."""

    def __init__(self, model_dir: str | Path, *, forward_hashes: bool = True) -> None:
        """``forward_hashes=False``: a worker that does not pass the frontend's hashes on (a negative control)."""
        from kvalign.oracles.sglang import _modules

        _modules()  # the torchvision shim and SGLang's import chain
        try:
            from dynamo.sglang._compat import supports_external_mm_hashes
            from dynamo.sglang.request_handlers.llm.mm_disagg_utils import (IMAGE_URL_KEY, extract_media_urls,
                                                                            extract_mm_hashes)
        except ImportError as exc:
            raise OracleUnavailable(f"dynamo.sglang's multimodal request handling is not importable ({exc})") from None
        try:
            from sglang.srt.entrypoints.engine import Engine
            from sglang.srt.managers import mm_utils
            from sglang.srt.managers.io_struct import GenerateReqInput
            from sglang.srt.managers.schedule_batch import MultimodalInputs
            from sglang.srt.managers.scheduler import Scheduler
            from sglang.srt.managers.tokenizer_manager import TokenizerManager
            from sglang.srt.runtime_context import publish, restore_context, snapshot_context
            from sglang.srt.sampling.sampling_params import SamplingParams
            from sglang.srt.server_args import ServerArgs
        except ImportError as exc:
            raise OracleUnavailable(f"SGLang's multimodal path is not importable ({exc})") from None
        self._extract_media_urls, self._extract_mm_hashes = extract_media_urls, extract_mm_hashes
        self._image_key = IMAGE_URL_KEY
        self._GenerateReqInput, self._MultimodalInputs, self._Scheduler = GenerateReqInput, MultimodalInputs, Scheduler
        self._mm_utils = mm_utils
        self._restore, self._snapshot = restore_context, snapshot_context
        self.model_dir = Path(model_dir)
        outside = snapshot_context()
        try:
            args = ServerArgs(model_path=str(self.model_dir), device="cpu", skip_server_warmup=True)
            args.resolve_once()  # as the engine's launch does, before its checks
            args.check_server_args()
            publish(args, role="tokenizer")
            tm = TokenizerManager.__new__(TokenizerManager)
            tm.server_args = args
            for name, value in dict(enable_metrics=False, incremental_streaming_output=False, enable_lora=False,
                                    enable_trace=False, allow_auto_truncate=False, skip_tokenizer_init=False,
                                    preferred_sampling_params=None, sampling_params_class=SamplingParams,
                                    fake_bootstrap_room_counter=0).items():
                setattr(tm, name, value)
            tm.init_model_config()
            tm.max_req_input_len = tm.model_config.context_len - 1
            tm.init_tokenizer_and_processor()
            tm._create_tokenized_object = _handed_to_scheduler
            if tm.mm_processor is None:
                raise OracleUnavailable(f"SGLang built no multimodal processor for {self.model_dir}")
            self.tokenizer_manager = tm
            self.engine = _EngineShape(Engine, tm)
            # Dynamo's own decision, and its own wrapper around SGLang's tokenizer when it says yes.
            self.takes_hashes = bool(supports_external_mm_hashes(self.engine)) and forward_hashes
            self.pad_input_ids = _model_pad_function(tm.model_config.hf_config)
            self.requires_modalities = tm.model_config.requires_mm_token_modalities
            self._ours = snapshot_context()
        except OracleUnavailable:
            raise
        except Exception as exc:
            raise OracleUnavailable(f"SGLang's multimodal processor does not start on CPU for {self.model_dir} "
                                    f"({type(exc).__name__}: {exc})") from None
        finally:
            restore_context(outside)
        self._loop = asyncio.new_event_loop()

    def process(self, request: dict[str, Any]) -> EngineRequest:
        """Run one recorded Dynamo ``PreprocessedRequest`` through SGLang's multimodal path."""
        outside = self._snapshot()
        self._restore(self._ours)
        try:
            return self._loop.run_until_complete(self._process(request))
        finally:
            self._restore(outside)

    async def _process(self, request: dict[str, Any]) -> EngineRequest:
        mm_data = request.get("multi_modal_data") or {}
        image_data = self._extract_media_urls(mm_data, self._image_key)
        forwarded = self._extract_mm_hashes(request) if self.takes_hashes else None
        obj = self._GenerateReqInput(input_ids=list(request["token_ids"]), image_data=image_data,
                                     mm_hashes=forwarded, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        obj.normalize_batch_and_arguments()
        tokenized = await self.tokenizer_manager._tokenize_one_request(obj)
        input_ids = [int(t) for t in tokenized.input_ids]
        mm = tokenized.mm_inputs
        if mm is None:
            return EngineRequest(input_ids, list(input_ids), (), forwarded)
        image_inputs = mm if isinstance(mm, self._MultimodalInputs) else self._MultimodalInputs.from_processor_output(
            mm, requires_mm_token_modalities=self.requires_modalities)
        req = types.SimpleNamespace(origin_input_ids=array("q", input_ids))
        recv = types.SimpleNamespace(input_ids=input_ids)
        if not self._Scheduler._try_apply_padded_mm_input_ids(recv, req, image_inputs):
            req.origin_input_ids = self._mm_utils.duplicate_pad_mm_input_ids(req.origin_input_ids, image_inputs,
                                                                             self.pad_input_ids)
        items = tuple(MmItem(it.hash, _pad_values(it), tuple((int(s), int(e)) for s, e in (it.offsets or ())))
                      for it in image_inputs.mm_items)
        return EngineRequest(input_ids, [int(t) for t in req.origin_input_ids], items, forwarded)

    def close(self) -> None:
        self._loop.close()


def _pad_values(item: Any) -> tuple[int, ...]:
    """An item's pad values: 0.5.23's ``padding_values()`` (four wide sentinels), else the one
    ``pad_value`` of the releases before it."""
    if item.pad_value is None:
        return ()
    if "padding_values" in type(item).__dict__:
        return tuple(int(v) for v in item.padding_values())
    return (int(item.pad_value),)


def _handed_to_scheduler(obj: Any, input_text: Any, input_ids: Sequence[int], input_embeds: Any, mm_inputs: Any,
                         token_type_ids: Any) -> types.SimpleNamespace:
    """Stands where ``TokenizerManager._create_tokenized_object`` packs the scheduler's message."""
    return types.SimpleNamespace(input_ids=list(input_ids), mm_inputs=mm_inputs, input_text=input_text)


def _model_pad_function(hf_config: Any) -> Any:
    """The scheduler's ``pad_input_ids_func``: the model class's own ``pad_input_ids``.

    The scheduler gets it from the loaded model; here the class is looked up in SGLang's model
    registry by the config's architecture and its method called without an instance (Qwen2-VL's reads no
    model state: it is ``pad_mm_tokens``)."""
    from sglang.srt.models.registry import ModelRegistry

    arch = hf_config.architectures[0]
    cls, _ = ModelRegistry.resolve_model_cls([arch])
    method = getattr(cls, "pad_input_ids", None)
    if method is None:
        raise OracleUnavailable(f"SGLang's {arch} has no pad_input_ids")
    return lambda input_ids, mm_inputs: method(None, input_ids, mm_inputs)
