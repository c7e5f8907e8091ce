"""The kv pair of :mod:`kvalign.live.engines.engine_model`: its target's output depends on every page
of the prompt's KV, and its EAGLE3 draft agrees with the target only when the draft's own KV is right.

Real libraries, no mocks: the target is transformers' ``LlamaForCausalLM`` (CPU, float32) loaded from
the written directory, the draft a reference of SGLang 0.5.23's EAGLE3 forward (:class:`Eagle3Draft`)
over the written draft safetensors, and both run greedy speculative chains as SGLang's EAGLE worker
does (draft extend over verified tokens, top-k 1 draft decode, target verify, longest prefix accepted).
Acceptance is measured, never forced.
"""

from __future__ import annotations

import copy
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

from kvalign.live.cluster.model_dir import WORDS
from kvalign.live.engines import engine_model
from kvalign.live.runs.scenario import prompt_tokens
from kvalign.standins.sglang_cpu.hooks import TORCHVISION_SHIM

for _name in TORCHVISION_SHIM:  # PyPI's torchvision is a CUDA build (the CPU stand-in's shim)
    sys.modules.setdefault(_name, ModuleType(_name))

from transformers import DynamicCache, LlamaForCausalLM  # noqa: E402

PAGE = 16
DECODE = 10


# --- the target (transformers) --------------------------------------------------------------------


def _target(path: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def _forward(model: LlamaForCausalLM, ids: list[int], cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy next ids after each of ``ids`` and SGLang's EAGLE3 aux features (aux layers [0, 1, 2]:
    the inputs of layers 1, 2, 3, i.e. ``hidden_states[1..3]``) at each, extending ``cache``."""
    out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in engine_model.AUX_LAYERS], dim=-1)
    return out.logits[0].argmax(-1), feats


def _greedy(model: LlamaForCausalLM, cache: DynamicCache, first: int, n: int) -> list[int]:
    out, tok = [], first
    for _ in range(n):
        nxt, _ = _forward(model, [tok], cache)
        tok = int(nxt[-1])
        out.append(tok)
    return out


def _prompts(target_dir: Path, lengths: list[int], seed: int = 7) -> list[list[int]]:
    """Chat prompts (the frontend's template: ``<|user|> words <|end|> <|assistant|>``) of these token
    counts, made of plain vocabulary words."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = prompt_tokens(str(target_dir), " ".join(rng.choice(WORDS) for _ in range(n - 3)))
        assert len(ids) == n
        out.append(ids)
    return out


# --- the draft: a reference of SGLang 0.5.23's EAGLE3 forward -------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``layers/layernorm.py`` RMSNorm.forward_native: with ``residual``, normalise ``x + residual`` and
    return the sum as the new residual."""
    x = x.float()
    if residual is not None:
        x = x + residual.float()
        residual = x
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return out if residual is None else (out, residual)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's neox-style rotary embedding (``get_rope(..., is_neox_style=True)``), ``x``: [T, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@dataclass
class Eagle3Draft:
    """SGLang 0.5.23's ``models/llama_eagle3.py`` forward, one sequence, followed line by line:

    * ``LlamaModel.forward``: ``embeds = embed_tokens(input_ids)`` (the target's: ``set_embed``), and
      ``hidden_states = spec_info.hidden_states`` go through ``fc`` only when their width differs from
      the embeds' (the target's 3H aux features; the draft's own H aux in draft decode);
    * ``LlamaDecoderLayer.forward`` (input layer): ``residual = hidden_states``,
      ``cat([input_layernorm(embeds), hidden_norm(hidden_states)])`` -> attention (q/k/v, RoPE, causal
      GQA over the draft's own KV, ``o_proj``) -> ``post_attention_layernorm(h, residual)`` -> MLP;
    * ``norm(h, residual)`` gives the logits' input, and the aux hidden state the next draft step takes:
      the normed output with ``norm_output`` (the kv draft's), else the pre-norm sum; ``lm_head`` its
      own (``tie_word_embeddings`` false, ``draft_vocab_size`` set).

    ``k``/``v`` are the draft's KV cache, one row per position (what a transfer must move)."""

    w: dict[str, torch.Tensor]
    cfg: dict
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)

    def forward(self, ids: list[int], hidden: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend the draft's KV at positions ``start..`` (truncating what lies beyond); next ids, aux."""
        w, c = self.w, self.cfg
        eps, h, hd = c["rms_norm_eps"], c["num_attention_heads"], c["head_dim"]
        kvh = c["num_key_value_heads"]
        del self.k[start:], self.v[start:]
        embeds = w["embed_tokens.weight"][torch.tensor(ids)]
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = hidden @ w["fc.weight"].T
        residual = hidden
        x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"], eps),
                       _rms(hidden, w["midlayer.hidden_norm.weight"], eps)], dim=-1)
        t = len(ids)
        pos = torch.arange(start, start + t)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, h, hd)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, kvh, hd)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, kvh, hd)
        q, k = _rope(q, pos, c["rope_theta"]), _rope(k, pos, c["rope_theta"])
        self.k.extend(k.unbind(0))
        self.v.extend(v.unbind(0))
        keys = torch.stack(self.k).repeat_interleave(h // kvh, dim=1)  # [S, h, hd]
        vals = torch.stack(self.v).repeat_interleave(h // kvh, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) * hd ** -0.5
        causal = torch.arange(len(self.k))[None, :] > pos[:, None]
        attn = torch.einsum("hts,shd->thd", scores.masked_fill(causal, float("-inf")).softmax(-1), vals)
        attn = attn.reshape(t, h * hd) @ w["midlayer.self_attn.o_proj.weight"].T
        x, residual = _rms(attn, w["midlayer.post_attention_layernorm.weight"], eps, residual)
        gate = x @ w["midlayer.mlp.gate_proj.weight"].T
        mlp = (torch.nn.functional.silu(gate) * (x @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
        normed, aux = _rms(mlp, w["norm.weight"], eps, residual)
        if self.cfg.get("norm_output", False):
            aux = normed
        return (normed @ w["lm_head.weight"].T).argmax(-1), aux


def _draft(draft_dir: Path, embed: torch.Tensor) -> Eagle3Draft:
    w = {k: v.float() for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
    w.setdefault("embed_tokens.weight", embed)  # SGLang shares the target's (set_embed)
    return Eagle3Draft(w, json.loads((draft_dir / "config.json").read_text()))


# --- greedy speculative decoding as SGLang's EAGLE worker runs it ------------------------------------


@dataclass
class Chain:
    tokens: list[int]
    proposed: int = 0
    accepted: int = 0
    first_proposed: int = 0
    first_accepted: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed

    @property
    def first_rate(self) -> float:
        return self.first_accepted / self.first_proposed


@torch.no_grad()
def _speculate(target: LlamaForCausalLM, draft: Eagle3Draft, prompt: list[int], n: int, steps: int,
               corrupt=None) -> Chain:
    """Decode ``n`` tokens greedily with EAGLE3 (``--speculative-num-steps steps``, top-k 1,
    ``steps + 1`` draft tokens). ``corrupt(draft)``, if given, runs on the draft's KV once the prompt's
    draft extend is done (what a prefill -> decode transfer hands over)."""
    cache = DynamicCache(config=target.config)
    nxt, feats = _forward(target, prompt, cache)  # prefill
    seq = [*prompt, int(nxt[-1])]
    # draft extend: position j takes token j + 1 and the target's features at j
    props, aux = draft.forward(seq[1:], feats, 0)
    if corrupt is not None:
        corrupt(draft)
    chain = Chain(tokens=[])
    while len(seq) - len(prompt) < n:
        base = len(seq) - 1  # seq[-1] is verified but not yet in the target's cache
        d = [int(props[-1])]
        h = aux[-1:]
        for k in range(1, steps):  # draft decode: the draft's own aux hidden state, its own KV
            p, h = draft.forward([d[-1]], h, base + k - 1)
            d.append(int(p[-1]))
        verified, vfeats = _forward(target, [seq[-1], *d], cache)  # verify
        m = 0
        while m < len(d) and d[m] == int(verified[m]):
            m += 1
        chain.proposed += len(d)
        chain.accepted += m
        chain.first_proposed += 1
        chain.first_accepted += m > 0
        cache.crop(base + 1 + m)
        new = [*d[:m], int(verified[m])]
        # draft extend over the verified positions base..base+m (drops the draft decode's rows)
        props, aux = draft.forward(new, vfeats[: m + 1], base)
        seq.extend(new)
    chain.tokens = seq[len(prompt): len(prompt) + n]
    return chain


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-pair")
    target_dir, agree_dir = engine_model.write_models(root, "agree", pair="kv")
    _, disagree_dir = engine_model.write_models(root, "disagree", pair="kv")
    zero_target, _ = engine_model.write_models(root, "agree")
    target = _target(target_dir)
    embed = target.model.embed_tokens.weight.detach()
    return {"dir": target_dir, "target": target, "zero": _target(zero_target),
            "agree": agree_dir, "disagree": disagree_dir, "embed": embed}
