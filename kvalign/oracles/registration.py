"""The card side of the router path: which ``enable_eagle`` ``dynamo.sglang`` registers, per algorithm.

The router hashes every query in EAGLE (B+1-token window) mode iff the worker's model card says
``enable_eagle``; SGLang keys its radix cache by bigrams iff its speculative algorithm
``is_eagle()`` (the predicate its KV-cache builder passes as ``CacheInitParams.is_eagle``). The
two were derived independently in Dynamo's history — a hand-kept ``("EAGLE", "NEXTN")`` set that
missed EAGLE3 and FROZEN_KV_MTP (#10982) — so the ``card`` property runs the installed
``dynamo.sglang`` registration code itself (``get_runtime_config``, ``_get_runtime_config`` before
1.5) with a worker's ``server_args`` for each algorithm, and reads the card it builds.

The registration function is called as a multimodal-encode worker calls it (no engine object, so
nothing needs a GPU); every argument it reads that this harness does not set falls back to the
value of a default-constructed ``DynamoConfig`` or to ``None``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvalign.oracles.base import OracleUnavailable

#: The registration functions that build the worker's ModelRuntimeConfig, newest first.
REGISTRATION_FUNCTIONS = ("get_runtime_config", "_get_runtime_config")


class _Args:
    """An argument record: explicit values, then a real default record's attributes, then ``None``."""

    def __init__(self, base: Any, **values: Any):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        return getattr(object.__getattribute__(self, "_base"), name, None)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__getattribute__(self, "_values")[name] = value


def speculative_algorithms() -> list[str | None]:
    """Every speculative algorithm the installed SGLang defines (as ``server_args`` holds it), and None."""
    from kvalign.oracles.sglang import _modules

    _modules()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return [None] + [m.name for m in SpeculativeAlgorithm if m.name != "NONE"]


def sglang_keys_bigrams(algorithm: str | None) -> bool:
    """SGLang's own rule: its radix cache is built with ``is_eagle=spec_algorithm.is_eagle()``."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return bool(SpeculativeAlgorithm.from_string(algorithm).is_eagle())


RegisterFn = Callable[[str | None], bool | None]


@dataclass
class Registration:
    """The installed ``dynamo.sglang`` registration code, ready to derive a card per algorithm."""

    function: str
    derive: RegisterFn  # algorithm -> the card's enable_eagle (None: the card has no such field)


def _dynamo_defaults(args_mod: Any) -> Any:
    """The ``DynamoConfig`` a worker started with no Dynamo flags gets, or None.

    As ``dynamo.sglang.args.parse_args`` builds it: the worker's own argument groups parsed from
    nothing, then ``validate()``. Some defaults exist only there: 1.3.1's ``enable_local_indexer``
    has no class default and is set by ``validate()``, so a bare ``from_cli_args`` leaves it unset
    and the registration code rejects ``None``. Releases without those groups fall back to the class
    defaults, then to none.
    """
    groups = [getattr(args_mod, g, None) for g in ("DynamoRuntimeArgGroup", "DynamoSGLangArgGroup")]
    if all(groups):
        try:
            parser = argparse.ArgumentParser()
            for group in groups:
                group().add_arguments(parser)
            config = args_mod.DynamoConfig.from_cli_args(parser.parse_known_args([])[0])
            config.validate()
            return config
        except Exception:  # noqa: BLE001 - a release whose groups cannot run bare: the class defaults below
            pass
    try:
        return args_mod.DynamoConfig.from_cli_args(argparse.Namespace())
    except Exception:  # older config classes: attribute defaults only
        return None


def load_registration() -> Registration:
    """The installed ``dynamo.sglang.register`` card builder, or :class:`OracleUnavailable` saying why."""
    from kvalign.oracles.sglang import _modules

    _modules()
    try:
        register = importlib.import_module("dynamo.sglang.register")
        args_mod = importlib.import_module("dynamo.sglang.args")
    except Exception as exc:  # an import chain this long fails in many ways; report the root
        raise OracleUnavailable(f"dynamo.sglang.register does not import here ({type(exc).__name__}: {exc})") from None
    name = next((n for n in REGISTRATION_FUNCTIONS if callable(getattr(register, n, None))), None)
    if name is None:
        raise OracleUnavailable(f"dynamo.sglang.register has none of {REGISTRATION_FUNCTIONS}")
    fn = getattr(register, name)
    dynamo_defaults = _dynamo_defaults(args_mod)

    def derive(algorithm: str | None) -> bool | None:
        server_args = _Args(None, speculative_algorithm=algorithm, disaggregation_mode="null", dp_size=1, tp_size=1,
                            pp_size=1, nnodes=1, node_rank=0, enable_dp_attention=False, page_size=1)
        dynamo_args = _Args(dynamo_defaults, use_kv_events=True, enable_multimodal=False)
        logging.disable(logging.WARNING)  # the function logs why it skips engine-only fields
        try:
            card = asyncio.run(fn(None, server_args, dynamo_args))
        finally:
            logging.disable(logging.NOTSET)
        if card is None:
            raise OracleUnavailable(f"dynamo.sglang.register.{name} returned no card")
        return getattr(card, "enable_eagle", None) if hasattr(type(card), "enable_eagle") or hasattr(card, "enable_eagle") else None

    return Registration(f"dynamo.sglang.register.{name}", derive)


#: ``dynamo.sglang.register``'s function that registers an LLM worker's model card (newest first).
BLOCK_SIZE_FUNCTIONS = ("_register_model_with_runtime_config",)
#: SGLang ``--disaggregation-mode`` -> the ``WorkerType`` member ``dynamo.sglang``'s init code registers with.
WORKER_TYPES = {"null": "Aggregated", "prefill": "Prefill", "decode": "Decode"}


class LaunchRefused(Exception):
    """``dynamo.sglang`` refuses to start with this configuration (its own launch checks)."""


@dataclass
class BlockSizeRegistration:
    """The installed ``dynamo.sglang``'s block sizes for a worker: the card's and the relay's.

    ``derive(server_args, role)`` runs what ``init_llm`` runs once ``sgl.Engine`` has resolved its
    arguments: ``Config.use_resolved_server_args(engine.server_args)`` (which also re-runs Dynamo's
    DCP launch checks, so a configuration Dynamo refuses raises ``ValueError``), then the
    registration function with those arguments. Its ``register_model`` call (the Rust binding that
    publishes the card) is replaced for the call by one that records its keyword arguments; the
    card's ``kv_cache_block_size`` is what it was given. The relay's block size is
    ``capacity.kv_event_block_size`` on the same arguments, as ``publisher.py`` builds each
    ``KvEventPublisher``. ``before_overrides=True`` skips the resolution step, handing the raw
    launch arguments to the same code: the negative control (a registration that reads the page
    size before SGLang's overrides).
    """

    function: str
    derive: Callable[..., tuple[int, int]]


def load_block_size_registration() -> BlockSizeRegistration:
    """The installed ``dynamo.sglang`` registration path of the card's block size, or :class:`OracleUnavailable`."""
    from kvalign.oracles.sglang import _modules

    _modules()
    try:
        register = importlib.import_module("dynamo.sglang.register")
        args_mod = importlib.import_module("dynamo.sglang.args")
        capacity = importlib.import_module("dynamo.sglang.capacity")
        from dynamo.llm import WorkerType
    except Exception as exc:  # an import chain this long fails in many ways; report the root
        raise OracleUnavailable(f"dynamo.sglang.register does not import here ({type(exc).__name__}: {exc})") from None
    name = next((n for n in BLOCK_SIZE_FUNCTIONS if callable(getattr(register, n, None))), None)
    missing = [what for what, ok in (
        (f"register.{'/'.join(BLOCK_SIZE_FUNCTIONS)}", name is not None),
        ("capacity.kv_event_block_size", callable(getattr(capacity, "kv_event_block_size", None))),
        ("args.Config.use_resolved_server_args", callable(getattr(getattr(args_mod, "Config", None), "use_resolved_server_args", None))),
    ) if not ok]
    if missing:
        raise OracleUnavailable(f"this dynamo.sglang has no {', '.join(missing)}: kvalign reads the registered block "
                                "size through them (Dynamo 1.5 and later)")
    fn = getattr(register, name)
    dynamo_defaults = _dynamo_defaults(args_mod)

    def derive(server_args: Any, role: str, *, before_overrides: bool = False) -> tuple[int, int]:
        config = args_mod.Config(server_args, dynamo_defaults)
        try:
            view = server_args if before_overrides else config.use_resolved_server_args(server_args)
        except ValueError as exc:  # Dynamo's launch checks refuse the configuration: the worker exits
            raise LaunchRefused(str(exc)) from None
        recorded: dict[str, Any] = {}

        async def register_model(*_args: Any, **kwargs: Any) -> None:
            recorded.update(kwargs)

        dynamo_args = _Args(dynamo_defaults, use_kv_events=True, enable_multimodal=False)
        original = register.register_model
        register.register_model = register_model
        logging.disable(logging.WARNING)
        try:
            ok = asyncio.run(fn(None, None, view, dynamo_args, worker_type=getattr(WorkerType, WORKER_TYPES[role])))
        finally:
            register.register_model = original
            logging.disable(logging.NOTSET)
        if not ok or "kv_cache_block_size" not in recorded:
            raise OracleUnavailable(f"dynamo.sglang.register.{name} registered no card")
        return int(recorded["kv_cache_block_size"]), int(capacity.kv_event_block_size(view))

    return BlockSizeRegistration(f"dynamo.sglang.register.{name}", derive)
