"""Loaded by every Python process of a vLLM CPU worker (its directory leads the worker's PYTHONPATH).

vLLM starts fresh interpreters of its own (``python -m vllm.model_executor.models.registry`` inspects
a model's architecture in a subprocess), which import transformers' image utilities and so PyPI's
torchvision, whose two op-registration modules fail beside torch+cpu ("operator torchvision::nms does
not exist"): they are pre-seeded empty in every such process, as for SGLang's oracle.
"""

import os
import sys
from types import ModuleType

if os.environ.get("KVALIGN_VLLM_SHIM") == "1":
    for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(_name, ModuleType(_name))
