"""The tiny Qwen2-VL the real SGLang engine serves on CPU, with random weights built offline.

The directory (tokenizer, configs, chat template) is :func:`kvalign.oracles.vlm_model.write_vlm_dir`,
the one the ``mm`` property runs Dynamo's frontend and SGLang's processor on; this adds the
weights, ``0.05 * randn`` with a fixed seed, in the checkpoint names SGLang's
``Qwen2VLForConditionalGeneration.load_weights`` reads (``visual.*``, ``model.*``, ``lm_head``):
a one-block vision tower (embed 32, 2 heads, patch 14, temporal patch 2, 2x2 merger into the LM's
hidden 64) and a 2-layer Qwen2 language model (hidden 64, 4 heads, 2 KV heads, vocab 512).

The LM head never emits token id 0. Dynamo's frontend pads its multimodal routing sequence to a
whole number of blocks with id 0, so a model that generated id 0 would make the router's last,
padded block equal the engine's page of prompt tail + output, and the live run would measure
that coincidence. The head is zero except two rows, ``+e0`` and ``-e0``, for two plain words:
greedy output is one of them, by the sign of the first hidden dimension.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvalign.oracles import vlm_model as vm

if TYPE_CHECKING:  # torch is imported when weights are built
    import torch

SEED = 0
#: The two words the head can emit (never id 0).
OUTPUT_WORDS = ("the", "fox")


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    import torch

    return 0.05 * torch.randn(*shape, generator=gen, dtype=torch.float32)


def _vision(gen: torch.Generator) -> dict[str, torch.Tensor]:
    import torch

    v = vm.VISION
    e, mlp = v["embed_dim"], v["embed_dim"] * v["mlp_ratio"]
    merged = e * vm.MERGE * vm.MERGE
    w = {"visual.patch_embed.proj.weight": _randn(gen, e, v["in_chans"], vm.TEMPORAL_PATCH, vm.PATCH, vm.PATCH)}
    for i in range(v["depth"]):
        p = f"visual.blocks.{i}"
        w |= {f"{p}.norm1.weight": torch.ones(e), f"{p}.norm1.bias": torch.zeros(e),
              f"{p}.norm2.weight": torch.ones(e), f"{p}.norm2.bias": torch.zeros(e),
              f"{p}.attn.qkv.weight": _randn(gen, 3 * e, e), f"{p}.attn.qkv.bias": torch.zeros(3 * e),
              f"{p}.attn.proj.weight": _randn(gen, e, e), f"{p}.attn.proj.bias": torch.zeros(e),
              f"{p}.mlp.fc1.weight": _randn(gen, mlp, e), f"{p}.mlp.fc1.bias": torch.zeros(mlp),
              f"{p}.mlp.fc2.weight": _randn(gen, e, mlp), f"{p}.mlp.fc2.bias": torch.zeros(e)}
    w |= {"visual.merger.ln_q.weight": torch.ones(e), "visual.merger.ln_q.bias": torch.zeros(e),
          "visual.merger.mlp.0.weight": _randn(gen, merged, merged), "visual.merger.mlp.0.bias": torch.zeros(merged),
          "visual.merger.mlp.2.weight": _randn(gen, vm.HIDDEN, merged), "visual.merger.mlp.2.bias": torch.zeros(vm.HIDDEN)}
    return w


def _language(gen: torch.Generator) -> dict[str, torch.Tensor]:
    import torch

    h, kv = vm.HIDDEN, vm.KV_HEADS * vm.HEAD_DIM
    w = {"model.embed_tokens.weight": _randn(gen, vm.VOCAB_SIZE, h)}
    for i in range(vm.LAYERS):
        p = f"model.layers.{i}"
        w |= {f"{p}.self_attn.q_proj.weight": _randn(gen, h, h), f"{p}.self_attn.q_proj.bias": torch.zeros(h),
              f"{p}.self_attn.k_proj.weight": _randn(gen, kv, h), f"{p}.self_attn.k_proj.bias": torch.zeros(kv),
              f"{p}.self_attn.v_proj.weight": _randn(gen, kv, h), f"{p}.self_attn.v_proj.bias": torch.zeros(kv),
              f"{p}.self_attn.o_proj.weight": _randn(gen, h, h),
              f"{p}.mlp.gate_proj.weight": _randn(gen, vm.INTERMEDIATE, h),
              f"{p}.mlp.up_proj.weight": _randn(gen, vm.INTERMEDIATE, h),
              f"{p}.mlp.down_proj.weight": _randn(gen, h, vm.INTERMEDIATE),
              f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h)}
    w["model.norm.weight"] = torch.ones(h)
    head = torch.zeros(vm.VOCAB_SIZE, h)
    plus, minus = (vm.token_id(word) for word in OUTPUT_WORDS)
    head[plus, 0], head[minus, 0] = 1.0, -1.0
    w["lm_head.weight"] = head
    return w


def vlm_weights() -> dict[str, torch.Tensor]:
    """Every tensor of the tiny Qwen2-VL, deterministic."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    return {**_vision(gen), **_language(gen)}


def write_vlm_model(path: str | Path) -> Path:
    """The model directory with weights; returns it."""
    from safetensors.torch import save_file

    root = vm.write_vlm_dir(path)
    save_file({k: v.contiguous() for k, v in vlm_weights().items()}, str(root / "model.safetensors"))
    return root
