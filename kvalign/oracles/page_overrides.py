"""SGLang's side of the advertised page size: which page size it forces, advertises and publishes.

SGLang overrides the page size a worker was started with for attention backends that only run at
some sizes (``arg_groups/overrides.py``: FlashMLA 64, TRT-LLM MLA / MHA, CuteDSL, HPC-Ops, FA4,
Intel XPU) and pages its radix tree at ``page_size * dcp_size`` under decode context parallelism.
A router told another size than the one the events carry drops every page (Dynamo #13216, SGLang
#35298). Each side's number is computed here by that side's own code:

* the configurations come from the installed release: :func:`page_overrides` reads
  ``overrides.py`` and lists every post-process pass that sets ``page_size``, with the attention
  backends it names;
* a configuration is resolved by SGLang's own ``ServerArgs.resolve_once`` (the whole pipeline,
  model overrides included) for a model config of each attention kind (MHA Llama, MLA DeepSeek-V3:
  a ``config.json`` only, no weights are read) on a GPU platform SGLang's own
  ``override_platform`` presents (Blackwell, Hopper, Intel XPU); a configuration the pipeline
  rejects is one SGLang does not accept, and is left out;
* what ``/server_info`` advertises is SGLang's ``describe_kv_events_publisher`` (the ``kv_events``
  block of ``build_server_info``) on those server arguments;
* what the events carry is a real SGLang radix cache at the tree's page size
  (:func:`kvalign.standins.kv_pages.tree_page_size`) storing one page: its ``BlockStored.block_size``.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.config_model import config_model_dir

#: Where a worker's KV events go (any routable TCP endpoint: ``/server_info`` describes only those).
KV_EVENTS_CONFIG = json.dumps({"publisher": "zmq", "topic": "", "endpoint": "tcp://127.0.0.1:5557"})

#: GPU platforms SGLang's own ``override_platform`` presents: (device flag, platform facts).
PLATFORMS: dict[str, tuple[str, dict[str, Any]]] = {
    "blackwell": ("cuda", {"is_cuda": True, "is_sm100": True, "is_sm100_or_sm110": True, "is_blackwell": True,
                           "has_flashinfer": True, "device_sm": 100, "device_capability": (10, 0)}),
    "hopper": ("cuda", {"is_cuda": True, "is_sm90": True, "is_hopper_with_cuda_12_3": True, "has_flashinfer": True,
                        "device_sm": 90, "device_capability": (9, 0)}),
    "xpu": ("xpu", {"is_xpu": True, "device_sm": 0, "device_capability": (0, 0)}),
}
#: Every yes/no fact a platform above does not set is False (this CPU's own probes never leak in).
_FACTS = ("is_cuda", "is_hip", "is_npu", "is_xpu", "is_musa", "is_mps", "is_sm90", "is_sm100", "is_sm100_or_sm110",
          "is_sm110", "is_sm120", "is_blackwell", "is_hopper_with_cuda_12_3", "has_amx", "has_flashinfer")

#: Model configs of each attention kind (a ``config.json`` is all the resolution reads).
MODELS: dict[str, dict[str, Any]] = {
    "mha": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 2048, "rope_theta": 10000.0, "hidden_act": "silu",
            "torch_dtype": "bfloat16"},
    "mla": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 512,
            "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 32,
            "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "max_position_embeddings": 2048, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16"},
}

#: Worker roles (SGLang's ``--disaggregation-mode``).
ROLES = ("null", "prefill", "decode")
#: The flags a backend can be named by (the overrides test each).
BACKEND_FLAGS = ("attention_backend", "decode_attention_backend", "prefill_attention_backend")


@dataclass(frozen=True)
class PageOverride:
    """One post-process pass of ``overrides.py`` that sets ``page_size``, and the backends it names."""

    function: str
    backends: tuple[str, ...]


@dataclass(frozen=True)
class WorkerConfig:
    """A worker's launch flags that decide its page size."""

    page_size: int | None = None
    backend: str | None = None
    backend_flag: str = "attention_backend"
    role: str = "null"
    model: str = "mha"
    platform: str = "blackwell"
    dcp_size: int = 1

    def flags(self) -> str:
        """The configuration as the launch flags a user types."""
        parts = [f"--page-size {self.page_size}" if self.page_size else "no --page-size"]
        if self.backend:
            parts.append(f"--{self.backend_flag.replace('_', '-')} {self.backend}")
        if self.dcp_size > 1:
            parts.append(f"--dcp-size {self.dcp_size} --tp-size {self.dcp_size}")
        if self.role != "null":
            parts.append(f"--disaggregation-mode {self.role}")
        return f"{' '.join(parts)} ({self.model.upper()} model on {self.platform})"


@dataclass(frozen=True)
class SglangSizes:
    """SGLang's numbers for one accepted configuration."""

    server_args: Any  # the ServerArgs record, resolved (its raw fields are still the launch flags)
    resolved_page: int
    advertised: int | None  # /server_info's kv_events.block_size (None: no descriptor)
    emitted: int  # BlockStored.block_size of a page the tree stores


def _sglang() -> None:
    from kvalign.oracles.sglang import _modules

    _modules()


def overrides_source() -> Path:
    """The installed ``arg_groups/overrides.py`` (:class:`OracleUnavailable` before the resolution API)."""
    _sglang()
    try:
        from sglang.srt.arg_groups import overrides
        from sglang.srt.runtime_context import describe_kv_events_publisher, override_platform  # noqa: F401
    except ImportError as exc:
        raise OracleUnavailable(f"this SGLang has no arg_groups.overrides ({exc}): its page-size overrides are "
                                "not read by kvalign") from None
    return Path(overrides.__file__)


def _sets_page_size(fn: ast.FunctionDef) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "page_size" for k in node.keys):
            return True
    return False


def page_overrides(source: str | None = None) -> list[PageOverride]:
    """Every ``@register_post_process`` pass in ``overrides.py`` that returns a ``page_size``, with the
    attention backends it names (string constants that are SGLang attention backends)."""
    _sglang()
    try:
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    except ImportError as exc:  # SGLang before its arg_groups (0.5.18 and older)
        raise OracleUnavailable(f"this SGLang has no arg_groups.choices ({exc}): its page-size overrides are "
                                "not read by kvalign") from None

    tree = ast.parse(source if source is not None else overrides_source().read_text())
    out = []
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef) or not _sets_page_size(fn):
            continue
        if not any(isinstance(d, ast.Name) and d.id == "register_post_process" for d in fn.decorator_list):
            continue
        named = [n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and n.value in ATTENTION_BACKEND_CHOICES]
        out.append(PageOverride(fn.name, tuple(dict.fromkeys(named))))
    return out


@cache
def _model_dirs() -> dict[str, str]:
    return {kind: config_model_dir(kind, config) for kind, config in MODELS.items()}


@contextmanager
def platform(name: str) -> Iterator[str]:
    """SGLang's ``override_platform`` presenting GPU platform ``name``; yields its ``--device``."""
    from sglang.srt import runtime_context

    known = set(getattr(runtime_context, "_PLATFORM_PROBES", {})) | set(getattr(runtime_context, "_PLATFORM_VALUES", {}))
    device, facts = PLATFORMS[name]
    wanted = {**{f: False for f in _FACTS}, **facts}
    with runtime_context.override_platform(**{k: v for k, v in wanted.items() if not known or k in known}):
        yield device


#: SGLang's hardware probes (``get_xpu_memory_capacity``, ``get_device_name``, ...). A configuration that fails
#: inside one failed on kvalign's platform stand-in (a GPU platform presented on a host without that device),
#: not by a rule of SGLang's: it is not checked, and never counted as SGLang's refusal.
HARDWARE_PROBE = re.compile(r"^get_\w*(memory_capacity|device_name|device_capability|device_count)\w*$")


class StandInFailure(OracleUnavailable):
    """SGLang's resolution failed in a hardware probe under kvalign's platform stand-in."""


def _probe(exc: BaseException) -> str | None:
    return next((f.name for f in reversed(traceback.extract_tb(exc.__traceback__)) if HARDWARE_PROBE.match(f.name)), None)


def resolve(config: WorkerConfig) -> Any:
    """The resolved ``ServerArgs`` SGLang builds for ``config``, or None when SGLang rejects it;
    :class:`StandInFailure` when it failed in a hardware probe of the presented platform instead."""
    _sglang()
    from sglang.srt.server_args import ServerArgs

    kw: dict[str, Any] = {"model_path": _model_dirs()[config.model], "kv_events_config": KV_EVENTS_CONFIG,
                          "disaggregation_mode": config.role}
    if config.page_size:
        kw["page_size"] = config.page_size
    if config.backend:
        kw[config.backend_flag] = config.backend
    if config.dcp_size > 1:
        kw.update(dcp_size=config.dcp_size, tp_size=config.dcp_size)
    logging.disable(logging.WARNING)  # the overrides log every change they make
    try:
        with platform(config.platform) as device:
            server_args = ServerArgs(device=device, **kw)
            try:
                server_args.resolve_once()
            except Exception as exc:  # noqa: BLE001 - SGLang refuses the configuration (it would not start)
                probe = _probe(exc)
                if probe is not None:
                    raise StandInFailure(f"kvalign's platform stand-in: {config.platform} presented on a host without "
                                         f"that device; SGLang's {probe} raised {type(exc).__name__}: {exc}") from None
                return None
            return server_args
    finally:
        logging.disable(logging.NOTSET)


@cache
def emitted_block_size(tree_page: int) -> int:
    """``BlockStored.block_size`` of the page a real SGLang radix cache at ``tree_page`` stores."""
    from kvalign.model.events import BlockStored
    from kvalign.oracles.sglang import SglangRadixCache

    cache_ = SglangRadixCache(tree_page, eagle=False)
    cache_.insert(list(range(tree_page)))
    sizes = {ev.block_size for ev in cache_.take_events() if isinstance(ev, BlockStored)}
    if len(sizes) != 1:
        raise OracleUnavailable(f"SGLang's cache at page size {tree_page} stored pages of sizes {sorted(sizes)}")
    return sizes.pop()


def sglang_sizes(config: WorkerConfig) -> SglangSizes | None:
    """SGLang's resolved page, advertised and emitted block sizes for ``config`` (None: rejected)."""
    server_args = resolve(config)
    if server_args is None:
        return None
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.runtime_context import describe_kv_events_publisher

    from kvalign.standins.kv_pages import tree_page_size

    with platform(config.platform):
        view = resolving_view(server_args)
        descriptor = describe_kv_events_publisher(server_args)
        tree_page = tree_page_size(view)
        resolved_page = int(view.page_size)
    return SglangSizes(server_args, resolved_page, None if descriptor is None else int(descriptor["block_size"]),
                       emitted_block_size(tree_page))


def dcp_supported() -> bool:
    """Whether this SGLang has decode context parallelism (a ``dcp_size`` server argument)."""
    _sglang()
    from sglang.srt.server_args import ServerArgs

    return "dcp_size" in getattr(ServerArgs, "__struct_fields__", ()) or hasattr(ServerArgs, "dcp_size")
