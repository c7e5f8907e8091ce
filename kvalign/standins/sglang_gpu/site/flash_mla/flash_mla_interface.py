"""Import-only placeholder: the one name SGLang 0.5.23's ``flash_mla_interface`` imports from here."""

from __future__ import annotations

from typing import Any


class FlashMLASchedMeta:
    """FlashMLA's scheduling metadata: never built for a triton-backend model."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        raise NotImplementedError("kvalign's GPU stand-in has no FlashMLA kernels (flash_mla is a placeholder)")
