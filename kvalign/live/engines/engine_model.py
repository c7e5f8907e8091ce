"""The tiny Llama target and EAGLE3 draft that the real SGLang engine serves on CPU, built offline.

No model hub is reachable in CI, so the real-engine layer builds its own weights: a
``LlamaForCausalLM`` (hidden 64, 4 layers — EAGLE3 captures aux layers [0, 1, 2], and SGLang's
default capture ``[2, L//2, L-3]`` breaks below 4 layers — 4 heads, 2 KV heads, head dim 16,
vocab 512) and a one-layer ``LlamaForCausalLMEagle3`` draft (``fc`` 3H -> H, attention input 2H),
both ``0.05 * randn`` with a fixed seed, written as safetensors next to the word-level tokenizer
of :mod:`kvalign.live.cluster.model_dir` (so kvalign tokenises prompts exactly as the frontend does).

The *target's LM head is zero*: its logits are constant, so greedy decoding always emits id 0
(the word ``ok``). That makes acceptance a property of the draft alone:

* ``draft="agree"`` — the draft's head is zero too, so every draft token is accepted
  (tokens per verify = ``--speculative-num-draft-tokens``);
* ``draft="disagree"`` — a random draft head proposes tokens the target never emits, so almost
  nothing is accepted (tokens per verify ~ 1): the live negative control for assertion 4.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvalign.live.cluster.model_dir import write_model_dir

if TYPE_CHECKING:  # torch is imported when weights are built, not by every kvalign command
    import torch

Draft = Literal["agree", "disagree"]
DRAFTS: tuple[Draft, ...] = ("agree", "disagree")

TARGET_NAME = "kvalign-tiny-llama"
LEADING_WORD = "ok"  # id 0: what the zero LM head always generates
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 4, 4, 2, 16, 512
AUX_LAYERS = [0, 1, 2]
SEED = 0


@dataclass(frozen=True)
class Shapes:
    """The tiny models' sizes and weight dtype. The CPU engine's are the module constants above; the
    GPU engine's (:data:`GPU`) are the shapes SGLang 0.5.23's CUDA path was first run with on the H100
    (hidden 256, head dim 64, bf16), which its triton attention and sgl-kernel norms take as they are.
    The zero LM head, the vocabulary and the tokenizer are the same, so kvalign's predictions are too."""

    hidden: int = HIDDEN
    intermediate: int = INTERMEDIATE
    layers: int = LAYERS
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    dtype: str = "float32"

    def config(self) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
            "hidden_size": self.hidden, "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "max_position_embeddings": 2048, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": self.dtype,
        }


CPU = Shapes()
GPU = Shapes(hidden=256, intermediate=512, head_dim=64, dtype="bfloat16")


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    import torch

    return 0.05 * torch.randn(*shape, generator=gen, dtype=torch.float32)


def _layer(gen: torch.Generator, prefix: str, attn_in: int, s: Shapes = CPU) -> dict[str, torch.Tensor]:
    """One Llama decoder layer's weights (``attn_in`` = 2H for the EAGLE3 midlayer)."""
    return {
        f"{prefix}.self_attn.q_proj.weight": _randn(gen, s.heads * s.head_dim, attn_in),
        f"{prefix}.self_attn.k_proj.weight": _randn(gen, s.kv_heads * s.head_dim, attn_in),
        f"{prefix}.self_attn.v_proj.weight": _randn(gen, s.kv_heads * s.head_dim, attn_in),
        f"{prefix}.self_attn.o_proj.weight": _randn(gen, s.hidden, s.heads * s.head_dim),
        f"{prefix}.mlp.gate_proj.weight": _randn(gen, s.intermediate, s.hidden),
        f"{prefix}.mlp.up_proj.weight": _randn(gen, s.intermediate, s.hidden),
        f"{prefix}.mlp.down_proj.weight": _randn(gen, s.hidden, s.intermediate),
        f"{prefix}.input_layernorm.weight": _ones(s.hidden),
        f"{prefix}.post_attention_layernorm.weight": _ones(s.hidden),
    }


def _ones(n: int) -> torch.Tensor:
    import torch

    return torch.ones(n)


def target_weights(s: Shapes = CPU) -> dict[str, torch.Tensor]:
    """The target's tensors (HF Llama names), LM head zero."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    w = {"model.embed_tokens.weight": _randn(gen, VOCAB, s.hidden)}
    for i in range(s.layers):
        w |= _layer(gen, f"model.layers.{i}", s.hidden, s)
    w["model.norm.weight"] = torch.ones(s.hidden)
    w["lm_head.weight"] = torch.zeros(VOCAB, s.hidden)
    return w


def draft_weights(draft: Draft, s: Shapes = CPU) -> dict[str, torch.Tensor]:
    """The EAGLE3 draft's tensors (SGLang's ``midlayer.*`` names); head zero or random."""
    if draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {draft!r}")
    import torch

    gen = torch.Generator().manual_seed(SEED + 1)
    w = _layer(gen, "midlayer", 2 * s.hidden, s)
    w["midlayer.hidden_norm.weight"] = torch.ones(s.hidden)
    w["fc.weight"] = _randn(gen, s.hidden, 3 * s.hidden)
    w["norm.weight"] = torch.ones(s.hidden)
    w["lm_head.weight"] = torch.zeros(VOCAB, s.hidden) if draft == "agree" else _randn(gen, VOCAB, s.hidden) * 20
    return w


def _save(weights: dict[str, torch.Tensor], root: Path, s: Shapes) -> None:
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, s.dtype)
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, str(root / "model.safetensors"))


def write_target(path: str | Path, s: Shapes = CPU) -> Path:
    """The target model directory (config, tokenizer, chat template, weights)."""
    root = write_model_dir(path, name=TARGET_NAME, leading_word=LEADING_WORD, config=s.config())
    _save(target_weights(s), root, s)
    return root


def write_draft(path: str | Path, draft: Draft = "agree", s: Shapes = CPU) -> Path:
    """The EAGLE3 draft directory for ``draft`` ("agree" or "disagree")."""
    config = {
        **s.config(), "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
        "draft_vocab_size": VOCAB, "target_hidden_size": s.hidden,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS},
    }
    root = write_model_dir(path, name=f"{TARGET_NAME}-eagle3-{draft}", leading_word=LEADING_WORD, config=config)
    _save(draft_weights(draft, s), root, s)
    (root / "kvalign-draft.json").write_text(json.dumps({"draft": draft}))
    return root


def write_models(path: str | Path, draft: Draft = "agree", s: Shapes = CPU) -> tuple[Path, Path]:
    """Target and draft under ``path`` (``target/``, ``draft-<draft>/``); returns both dirs."""
    root = Path(path)
    return write_target(root / "target", s), write_draft(root / f"draft-{draft}", draft, s)
