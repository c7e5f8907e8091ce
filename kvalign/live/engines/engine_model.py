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

_SHAPES = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
    "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "max_position_embeddings": 2048, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "float32",
}


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    import torch

    return 0.05 * torch.randn(*shape, generator=gen, dtype=torch.float32)


def _layer(gen: torch.Generator, prefix: str, attn_in: int) -> dict[str, torch.Tensor]:
    """One Llama decoder layer's weights (``attn_in`` = 2H for the EAGLE3 midlayer)."""
    return {
        f"{prefix}.self_attn.q_proj.weight": _randn(gen, HEADS * HEAD_DIM, attn_in),
        f"{prefix}.self_attn.k_proj.weight": _randn(gen, KV_HEADS * HEAD_DIM, attn_in),
        f"{prefix}.self_attn.v_proj.weight": _randn(gen, KV_HEADS * HEAD_DIM, attn_in),
        f"{prefix}.self_attn.o_proj.weight": _randn(gen, HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": _randn(gen, INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": _randn(gen, INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": _randn(gen, HIDDEN, INTERMEDIATE),
        f"{prefix}.input_layernorm.weight": _ones(HIDDEN),
        f"{prefix}.post_attention_layernorm.weight": _ones(HIDDEN),
    }


def _ones(n: int) -> torch.Tensor:
    import torch

    return torch.ones(n)


def target_weights() -> dict[str, torch.Tensor]:
    """The target's tensors (HF Llama names), LM head zero."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    w = {"model.embed_tokens.weight": _randn(gen, VOCAB, HIDDEN)}
    for i in range(LAYERS):
        w |= _layer(gen, f"model.layers.{i}", HIDDEN)
    w["model.norm.weight"] = torch.ones(HIDDEN)
    w["lm_head.weight"] = torch.zeros(VOCAB, HIDDEN)
    return w


def draft_weights(draft: Draft) -> dict[str, torch.Tensor]:
    """The EAGLE3 draft's tensors (SGLang's ``midlayer.*`` names); head zero or random."""
    if draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {draft!r}")
    import torch

    gen = torch.Generator().manual_seed(SEED + 1)
    w = _layer(gen, "midlayer", 2 * HIDDEN)
    w["midlayer.hidden_norm.weight"] = torch.ones(HIDDEN)
    w["fc.weight"] = _randn(gen, HIDDEN, 3 * HIDDEN)
    w["norm.weight"] = torch.ones(HIDDEN)
    w["lm_head.weight"] = torch.zeros(VOCAB, HIDDEN) if draft == "agree" else _randn(gen, VOCAB, HIDDEN) * 20
    return w


def _save(weights: dict[str, torch.Tensor], root: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in weights.items()}, str(root / "model.safetensors"))


def write_target(path: str | Path) -> Path:
    """The target model directory (config, tokenizer, chat template, weights)."""
    root = write_model_dir(path, name=TARGET_NAME, leading_word=LEADING_WORD, config=_SHAPES)
    _save(target_weights(), root)
    return root


def write_draft(path: str | Path, draft: Draft = "agree") -> Path:
    """The EAGLE3 draft directory for ``draft`` ("agree" or "disagree")."""
    config = {
        **_SHAPES, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
        "draft_vocab_size": VOCAB, "target_hidden_size": HIDDEN,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS},
    }
    root = write_model_dir(path, name=f"{TARGET_NAME}-eagle3-{draft}", leading_word=LEADING_WORD, config=config)
    _save(draft_weights(draft), root)
    (root / "kvalign-draft.json").write_text(json.dumps({"draft": draft}))
    return root


def write_models(path: str | Path, draft: Draft = "agree") -> tuple[Path, Path]:
    """Target and draft under ``path`` (``target/``, ``draft-<draft>/``); returns both dirs."""
    root = Path(path)
    return write_target(root / "target"), write_draft(root / f"draft-{draft}", draft)
