"""The tiny Llama targets and EAGLE3 drafts that the real SGLang engine serves on CPU, built offline.

No model hub is reachable in CI, so the real-engine layer builds its own weights: a
``LlamaForCausalLM`` (hidden 64, 4 layers — EAGLE3 captures aux layers [0, 1, 2], and SGLang's
default capture ``[2, L//2, L-3]`` breaks below 4 layers — 4 heads, 2 KV heads, head dim 16,
vocab 512) and a one-layer ``LlamaForCausalLMEagle3`` draft (``fc`` 3H -> H, attention input 2H),
written as safetensors next to the word-level tokenizer of :mod:`kvalign.live.cluster.model_dir`
(so kvalign tokenises prompts exactly as the frontend does). Two pairs of them (:data:`PAIRS`),
each for what the other cannot show:

``pair="zero-head"`` (the default) — both ``0.05 * randn`` with a fixed seed, and the *target's LM
head is zero*: its logits are constant, so greedy decoding always emits id 0 (the word ``ok``),
whatever its KV cache holds. That makes acceptance a property of the draft alone (the "draft
agrees" scenario), independent of what a prefill -> decode transfer moved:

* ``draft="agree"`` — the draft's head is zero too, so every draft token is accepted
  (tokens per verify = ``--speculative-num-draft-tokens``);
* ``draft="disagree"`` — a random draft head proposes tokens the target never emits, so almost
  nothing is accepted (tokens per verify ~ 1): the live negative control for assertion 4.

``pair="kv"`` — a target whose greedy output depends on every page of the prompt's KV, and a draft
that agrees with it only when the draft's own KV is right. A transfer that moves nothing (or the
wrong pages) changes the decoded text; one that drops the draft's state drops acceptance (measured
by SGLang, never forced). How (SGLang 0.5.23's ``models/llama.py`` / ``llama_eagle3.py``):

* target: layer 0 is the only effective layer. Its ``q_proj`` is zero, so every attention score is
  0 and causal attention is the *uniform mean* of ``V`` over positions ``0..p`` (RoPE drops out);
  its ``o_proj`` is large, so that mean dominates the residual; its MLP and layers 1..3 add nothing
  (``o_proj`` / ``down_proj`` zero). Tokens have small random embeddings, except those a prompt
  opens with (:data:`KV_ZERO_EMBED`: ``V(x_0) = 0``). So
  ``h(p) = e(x_p) + Wo · mean_{j<=p} Wv·n(e(x_j))``, and the LM head reads ``n(h(p))``: its rows of
  plain vocabulary words are evenly spaced on a circle of one plane (:func:`_kv_target_weights`), every other
  row zero, so greedy output is always a plain word (never EOS) and one token's ``V`` turns the
  output by about a word: zero any page's ``V`` and the output changes (on random 33-90 token chat
  prompts, within 10 decoded tokens for all but ~0.2% of pages);
* ``draft="agree"`` (the *mirror*): ``fc`` and ``q_proj`` zero (uniform over the draft's own KV),
  ``v_proj = [Wv | 0]`` on the ``[input_layernorm(embeds), hidden_norm(fc(features))]`` input,
  ``o_proj = Wo``, MLP zero, embedding the target's (SGLang shares it anyway), head the target's over
  :data:`KV_DRAFT_NORM`. The draft at position ``i`` holds ``V(x_{j+1})`` for ``j <= i``, so it reads
  ``n(Wo · sum_{j=1..i+1} V(x_j))`` — the direction the target reads at ``i + 1`` (``V(x_0) = 0``) up
  to the tiny embedding: it agrees when its KV is right, and not when that KV is zeroed or another
  prompt's. ``norm_output`` with the small final norm keeps later draft-decode steps (the GPU kind's
  3) on the same mean; ``enable_lm_head_fp32`` (both configs) keeps bf16 logits from tying neighbours;
* ``draft="disagree"``: the mirror with a random head, the never-agreeing negative control.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvalign.live.cluster.model_dir import WORDS, vocab, write_model_dir

if TYPE_CHECKING:  # torch is imported when weights are built, not by every kvalign command
    import torch

Draft = Literal["agree", "disagree"]
DRAFTS: tuple[Draft, ...] = ("agree", "disagree")
Pair = Literal["zero-head", "kv"]
PAIRS: tuple[Pair, ...] = ("zero-head", "kv")

TARGET_NAME = "kvalign-tiny-llama"
LEADING_WORD = "ok"  # id 0: what the zero LM head always generates
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 4, 4, 2, 16, 512
AUX_LAYERS = [0, 1, 2]
SEED = 0
KV_SEED = 2  # the kv pair's generator (the zero-head pair's seeds are SEED and SEED + 1)
#: kv pair: the embeddings' RMS (small: the residual ``e(x_p)`` hardly moves ``h(p)``; RMSNorm makes
#: ``V`` independent of it, and it stays well above ``rms_norm_eps``) and ``o_proj``'s scale (large:
#: the attention mean dominates that residual, which is ~1e-3 of it on 40-200 token prompts).
KV_EMBED_SCALE, KV_O_SCALE = 0.01, 100.0
#: kv pair: the tokens a prompt opens with (BOS, the chat roles a conversation starts with) have a zero
#: embedding, so ``V(x_0) = 0`` — the one token the draft never holds (its position j holds x_{j+1}).
#: The other special tokens have one: every chat prompt ends ``<|end|> <|assistant|>``, and a last
#: page holding only those must change the output too — so those two share one embedding (two random
#: ones can all but cancel: with an earlier seed their turns summed to a fifth of one token's).
KV_ZERO_EMBED = ("<s>", "<|user|>", "<|system|>")
KV_CLOSING = ("<|end|>", "<|assistant|>")
#: kv draft: its final norm's weight (with ``norm_output``: the aux hidden state a draft-decode step
#: hands the next is ``norm(h)``, this small against the attention term, so multi-step drafting reads
#: the same mean as the first step; its head is the target's over this, the same argmax).
KV_DRAFT_NORM = 2.0 ** -10  # a power of two: the head over it rounds to bf16 as the target's does
RMS_NORM_EPS = 1e-6
#: kv pair's config keys, target and draft: SGLang's LogitsProcessor computes the LM head in float32
#: with ``enable_lm_head_fp32`` — neighbouring words' logits differ by less than a bf16 step (GPU shapes)
KV_CONFIG = {"rms_norm_eps": RMS_NORM_EPS, "enable_lm_head_fp32": True}


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


def _check_pair(pair: Pair) -> None:
    if pair not in PAIRS:
        raise ValueError(f"pair must be one of {PAIRS}, got {pair!r}")


def target_weights(s: Shapes = CPU, *, pair: Pair = "zero-head") -> dict[str, torch.Tensor]:
    """The target's tensors (HF Llama names): LM head zero ("zero-head") or KV-dependent ("kv")."""
    _check_pair(pair)
    if pair == "kv":
        return _kv_target_weights(s)
    import torch

    gen = torch.Generator().manual_seed(SEED)
    w = {"model.embed_tokens.weight": _randn(gen, VOCAB, s.hidden)}
    for i in range(s.layers):
        w |= _layer(gen, f"model.layers.{i}", s.hidden, s)
    w["model.norm.weight"] = torch.ones(s.hidden)
    w["lm_head.weight"] = torch.zeros(VOCAB, s.hidden)
    return w


def draft_weights(draft: Draft, s: Shapes = CPU, *, pair: Pair = "zero-head") -> dict[str, torch.Tensor]:
    """The EAGLE3 draft's tensors (SGLang's ``midlayer.*`` names); head zero or random ("zero-head"),
    the target's mirror or random ("kv")."""
    if draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {draft!r}")
    _check_pair(pair)
    if pair == "kv":
        return _kv_draft_weights(draft, s)
    import torch

    gen = torch.Generator().manual_seed(SEED + 1)
    w = _layer(gen, "midlayer", 2 * s.hidden, s)
    w["midlayer.hidden_norm.weight"] = torch.ones(s.hidden)
    w["fc.weight"] = _randn(gen, s.hidden, 3 * s.hidden)
    w["norm.weight"] = torch.ones(s.hidden)
    w["lm_head.weight"] = torch.zeros(VOCAB, s.hidden) if draft == "agree" else _randn(gen, VOCAB, s.hidden) * 20
    return w


def plain_word_ids() -> list[int]:
    """Token ids of the plain vocabulary words (:data:`~kvalign.live.cluster.model_dir.WORDS`, the
    leading word included): the only rows of the kv target's LM head that are not zero."""
    v = vocab(LEADING_WORD)
    return sorted(v[w] for w in WORDS)


def _kv_turns(s: Shapes, w: dict[str, torch.Tensor], plane: torch.Tensor) -> torch.Tensor:
    """``M`` (2 x H): what a token's normed embedding adds, through layer 0's ``V`` (each KV head read by
    its ``heads // kv_heads`` query heads) and ``o_proj``, to the output plane: its *turn* ``u``."""
    wv = w["model.layers.0.self_attn.v_proj.weight"].view(s.kv_heads, s.head_dim, s.hidden)
    wv = wv.repeat_interleave(s.heads // s.kv_heads, dim=0).reshape(s.heads * s.head_dim, s.hidden)
    return plane.T @ w["model.layers.0.self_attn.o_proj.weight"] @ wv


def _kv_embed(gen: torch.Generator, s: Shapes, m: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Embeddings whose turns ``u = M · n(e)`` all have one length, at the angles ``alpha``: the part of
    ``e`` in ``M``'s row space is the least-norm solution, the rest random, the norm fixed. (Random
    embeddings give turns of random lengths, and a word whose turn is short can keep the output on
    itself for good: a changed page then no longer shows.)"""
    import torch

    left, sigma, rows = torch.linalg.svd(m.double(), full_matrices=False)  # rows: 2 x H
    turns = torch.stack([alpha.cos(), alpha.sin()], 1).double()
    d = turns @ left @ torch.diag(1 / sigma) @ rows  # M d = turn, d in M's row space
    z = torch.randn(len(alpha), s.hidden, generator=gen).double()
    z -= (z @ rows.T) @ rows
    norm = KV_EMBED_SCALE * s.hidden ** 0.5
    d *= 0.7 * norm / d.norm(dim=1).max()
    z *= ((norm ** 2 - d.pow(2).sum(1, keepdim=True)) / z.pow(2).sum(1, keepdim=True)).sqrt()
    return (d + z).float()


def _kv_target_weights(s: Shapes) -> dict[str, torch.Tensor]:
    """The kv target (module docstring): layer 0's uniform attention mean is the whole model.

    Its LM head: the plain words' rows are evenly spaced unit vectors on a circle of a random plane,
    every other row zero, so greedy output is the word nearest the angle of ``n(h)``'s projection on
    that plane, and every word is reachable (a random head in H dimensions let a page's worth of ``V``
    change ``h`` without changing the argmax). Every token turns that projection by the same length
    (:func:`_kv_embed`), a word in the direction a quarter turn from its own slot: the output moves on
    from each word it emits instead of settling on one, and one token turns it by about a word."""
    import math

    import torch

    gen = torch.Generator().manual_seed(KV_SEED)
    v = vocab(LEADING_WORD)
    qkv_out, attn_out = s.kv_heads * s.head_dim, s.heads * s.head_dim
    w: dict[str, torch.Tensor] = {}
    for i in range(s.layers):
        layer = _layer(gen, f"model.layers.{i}", s.hidden, s)
        layer[f"model.layers.{i}.mlp.down_proj.weight"] = torch.zeros(s.hidden, s.intermediate)
        if i == 0:
            layer["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(attn_out, s.hidden)
            layer["model.layers.0.self_attn.v_proj.weight"] = (
                torch.randn(qkv_out, s.hidden, generator=gen) / s.hidden ** 0.5)
            layer["model.layers.0.self_attn.o_proj.weight"] = (
                KV_O_SCALE * torch.randn(s.hidden, attn_out, generator=gen) / attn_out ** 0.5)
        else:  # identity: the residual passes through
            layer[f"model.layers.{i}.self_attn.o_proj.weight"] = torch.zeros(s.hidden, attn_out)
        w |= layer
    w["model.norm.weight"] = torch.ones(s.hidden)
    plane, _ = torch.linalg.qr(torch.randn(s.hidden, 2, generator=gen))
    words = torch.tensor(plain_word_ids())
    alpha = 2 * math.pi * torch.rand(VOCAB, generator=gen, dtype=torch.float64)
    alpha[words] = 2 * math.pi * torch.randperm(len(words), generator=gen).double() / len(words)
    # every id (those past the tokenizer's too: token-id prompts use them) but KV_ZERO_EMBED's: V != 0
    embed = _kv_embed(gen, s, _kv_turns(s, w, plane), alpha)
    embed[torch.tensor([v[t] for t in KV_ZERO_EMBED])] = 0
    embed[v[KV_CLOSING[1]]] = embed[v[KV_CLOSING[0]]]
    w["model.embed_tokens.weight"] = embed
    head = torch.zeros(VOCAB, s.hidden)  # EOS and the other special tokens are never generated
    slots = alpha[words] + math.pi / 2
    head[words] = torch.stack([slots.cos(), slots.sin()], 1).float() @ plane.T
    w["lm_head.weight"] = head
    return w


def _kv_draft_weights(draft: Draft, s: Shapes) -> dict[str, torch.Tensor]:
    """The kv pair's EAGLE3 draft: the target's layer 0 read from the draft's own KV (module docstring)."""
    import torch

    t = _kv_target_weights(s)
    gen = torch.Generator().manual_seed(KV_SEED + 1)
    qkv_out, attn_out = s.kv_heads * s.head_dim, s.heads * s.head_dim
    w = _layer(gen, "midlayer", 2 * s.hidden, s)
    w["midlayer.self_attn.q_proj.weight"] = torch.zeros(attn_out, 2 * s.hidden)
    # attention input is cat([input_layernorm(embeds), hidden_norm(fc(features))]): V reads the embeds half
    w["midlayer.self_attn.v_proj.weight"] = torch.cat(
        [t["model.layers.0.self_attn.v_proj.weight"], torch.zeros(qkv_out, s.hidden)], dim=1)
    w["midlayer.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"].clone()
    w["midlayer.mlp.down_proj.weight"] = torch.zeros(s.hidden, s.intermediate)
    w["midlayer.hidden_norm.weight"] = torch.ones(s.hidden)
    w["fc.weight"] = torch.zeros(s.hidden, 3 * s.hidden)  # the draft's residual is 0
    w["norm.weight"] = torch.full((s.hidden,), KV_DRAFT_NORM)  # with "norm_output": the aux it hands on
    # SGLang shares the target's embedding with an EAGLE3 draft of the same hidden size (set_embed);
    # the draft carries it too, for a loader that reads the draft's own.
    w["embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
    w["lm_head.weight"] = (t["lm_head.weight"] / KV_DRAFT_NORM if draft == "agree"
                           else _randn(gen, VOCAB, s.hidden) * 20 / KV_DRAFT_NORM)
    return w


def _save(weights: dict[str, torch.Tensor], root: Path, s: Shapes) -> None:
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, s.dtype)
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, str(root / "model.safetensors"))


def target_name(pair: Pair = "zero-head") -> str:
    """The target's ``_name_or_path`` (the engine serves either as :data:`TARGET_NAME`)."""
    _check_pair(pair)
    return TARGET_NAME if pair == "zero-head" else f"{TARGET_NAME}-{pair}"


def write_target(path: str | Path, s: Shapes = CPU, *, pair: Pair = "zero-head") -> Path:
    """The target model directory (config, tokenizer, chat template, weights)."""
    config = s.config() if pair == "zero-head" else {**s.config(), **KV_CONFIG}
    root = write_model_dir(path, name=target_name(pair), leading_word=LEADING_WORD, config=config)
    _save(target_weights(s, pair=pair), root, s)
    return root


def write_draft(path: str | Path, draft: Draft = "agree", s: Shapes = CPU, *, pair: Pair = "zero-head") -> Path:
    """The EAGLE3 draft directory for ``draft`` ("agree" or "disagree") of ``pair``."""
    _check_pair(pair)
    config = {
        **s.config(), "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
        "draft_vocab_size": VOCAB, "target_hidden_size": s.hidden,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS},
    }
    if pair != "zero-head":  # norm_output: the aux hidden state of a draft step is norm(h) (KV_DRAFT_NORM)
        config |= {**KV_CONFIG, "norm_output": True}
    root = write_model_dir(path, name=f"{target_name(pair)}-eagle3-{draft}", leading_word=LEADING_WORD, config=config)
    _save(draft_weights(draft, s, pair=pair), root, s)
    meta = {"draft": draft} if pair == "zero-head" else {"draft": draft, "pair": pair}
    (root / "kvalign-draft.json").write_text(json.dumps(meta))
    return root


def write_models(path: str | Path, draft: Draft = "agree", s: Shapes = CPU, *,
                 pair: Pair = "zero-head") -> tuple[Path, Path]:
    """Target and draft under ``path`` (``target/``, ``draft-<draft>/``; the kv pair ``target-kv/``,
    ``draft-kv-<draft>/``); returns both dirs."""
    _check_pair(pair)
    root = Path(path)
    tag = "" if pair == "zero-head" else f"-{pair}"
    return (write_target(root / f"target{tag}", s, pair=pair),
            write_draft(root / f"draft{tag}-{draft}", draft, s, pair=pair))
