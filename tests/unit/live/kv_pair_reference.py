"""The references :mod:`test_engine_model_kv_pair` runs the kv pair against: transformers' target, a
reference of SGLang 0.5.23's EAGLE3 draft forward, and greedy speculative chains as SGLang's EAGLE worker
runs them (the test file's docstring says what each proves).

A module of its own, imported by the test file's ``ref`` fixture, so torch (about 2.4 CPU-s) and
transformers load when those tests run, on a worker that already holds them with SGLang
(``tests/xdist_scopes.py``), and not in every xdist worker's collection.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from kvalign.live.cluster.model_dir import WORDS
from kvalign.live.engines import engine_model
from kvalign.live.runs.scenario import prompt_tokens
from kvalign.standins.sglang_cpu.hooks import TORCHVISION_SHIM

if TYPE_CHECKING:
    from transformers import DynamicCache, LlamaForCausalLM

PAGE = 16
DECODE = 10


# --- the target (transformers) --------------------------------------------------------------------


def _transformers():
    """transformers, imported when a test runs (seconds: not at collection)."""
    for name in TORCHVISION_SHIM:  # PyPI's torchvision is a CUDA build (the CPU stand-in's shim)
        sys.modules.setdefault(name, ModuleType(name))
    import transformers

    return transformers


def load_target(path: Path) -> LlamaForCausalLM:
    model = _transformers().LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def new_cache(model: LlamaForCausalLM) -> DynamicCache:
    return _transformers().DynamicCache(config=model.config)


@torch.no_grad()
def target_forward(model: LlamaForCausalLM, ids: list[int], cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy next ids after each of ``ids`` and SGLang's EAGLE3 aux features (aux layers [0, 1, 2]:
    the inputs of layers 1, 2, 3, i.e. ``hidden_states[1..3]``) at each, extending ``cache``."""
    out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in engine_model.AUX_LAYERS], dim=-1).float()
    return out.logits[0].argmax(-1), feats


def greedy_decode(model: LlamaForCausalLM, cache: DynamicCache, first: int, n: int) -> list[int]:
    out, tok = [], first
    for _ in range(n):
        nxt, _ = target_forward(model, [tok], cache)
        tok = int(nxt[-1])
        out.append(tok)
    return out


def chat_prompts(target_dir: Path, lengths: list[int], seed: int = 1) -> list[list[int]]:
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
      the embeds' (the target's 3H aux features in draft extend, not the draft's own H aux in draft
      decode); the input ids are the target's shifted left by one (``_draft_extend_for_prefill``);
    * ``LlamaDecoderLayer.forward`` (input layer): ``residual = hidden_states``,
      ``cat([input_layernorm(embeds), hidden_norm(hidden_states)])`` -> attention (q/k/v, RoPE, causal
      GQA over the draft's own KV, ``o_proj``) -> ``post_attention_layernorm(h, residual)`` -> MLP;
    * ``norm(h, residual)`` gives the logits' input, and the aux hidden state the next draft step takes:
      the normed output with ``norm_output`` (the kv draft's), else the pre-norm sum; ``lm_head`` its
      own (``tie_word_embeddings`` false, ``draft_vocab_size`` set).

    ``k``/``v`` are the draft's KV cache, one row per position (what a transfer must move). Norms and
    softmax compute in float32 and return ``dtype`` (the weights' and activations'), as SGLang's do."""

    w: dict[str, torch.Tensor]
    cfg: dict
    dtype: torch.dtype = torch.float32
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)

    def forward(self, ids: list[int], hidden: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend the draft's KV at positions ``start..`` (truncating what lies beyond); next ids, aux."""
        w, c, dt = self.w, self.cfg, self.dtype
        eps, h, hd = c["rms_norm_eps"], c["num_attention_heads"], c["head_dim"]
        kvh = c["num_key_value_heads"]
        del self.k[start:], self.v[start:]
        embeds, hidden = w["embed_tokens.weight"][torch.tensor(ids)], hidden.to(dt)
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = hidden @ w["fc.weight"].T
        residual = hidden
        x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"], eps).to(dt),
                       _rms(hidden, w["midlayer.hidden_norm.weight"], eps).to(dt)], dim=-1)
        t = len(ids)
        pos = torch.arange(start, start + t)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, h, hd)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, kvh, hd)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, kvh, hd)
        q, k = _rope(q, pos, c["rope_theta"]).to(dt), _rope(k, pos, c["rope_theta"]).to(dt)
        self.k.extend(k.unbind(0))
        self.v.extend(v.unbind(0))
        keys = torch.stack(self.k).repeat_interleave(h // kvh, dim=1)  # [S, h, hd]
        vals = torch.stack(self.v).repeat_interleave(h // kvh, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) * hd ** -0.5
        causal = torch.arange(len(self.k))[None, :] > pos[:, None]
        probs = scores.float().masked_fill(causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hts,shd->thd", probs, vals.float()).to(dt)
        attn = attn.reshape(t, h * hd) @ w["midlayer.self_attn.o_proj.weight"].T
        x, residual = _rms(attn, w["midlayer.post_attention_layernorm.weight"], eps, residual)
        x, residual = x.to(dt), residual.to(dt)
        gate = x @ w["midlayer.mlp.gate_proj.weight"].T
        mlp = (torch.nn.functional.silu(gate) * (x @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
        normed, aux = _rms(mlp, w["norm.weight"], eps, residual)
        normed, aux = normed.to(dt), aux.to(dt)
        if self.cfg.get("norm_output", False):
            aux = normed
        head = w["lm_head.weight"]  # LogitsProcessor: in float32 with the config's enable_lm_head_fp32
        logits = normed.float() @ head.float().T if c.get("enable_lm_head_fp32") else normed @ head.T
        return logits.argmax(-1), aux


def load_draft(draft_dir: Path, embed: torch.Tensor, dtype: torch.dtype = torch.float32) -> Eagle3Draft:
    w = {k: v.to(dtype) for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
    w.setdefault("embed_tokens.weight", embed.to(dtype))  # SGLang shares the target's (set_embed)
    return Eagle3Draft(w, json.loads((draft_dir / "config.json").read_text()), dtype)


# --- greedy speculative decoding as SGLang's EAGLE worker runs it ------------------------------------


@dataclass
class Chain:
    """One prompt's speculative decode: its tokens, draft tokens proposed and accepted (all, and the
    first of each verify alone)."""

    tokens: list[int]
    proposed: int = 0
    accepted: int = 0
    first_proposed: int = 0
    first_accepted: int = 0


@torch.no_grad()
def speculate(target: LlamaForCausalLM, draft: Eagle3Draft, prompt: list[int], n: int, steps: int,
               corrupt=None) -> Chain:
    """Decode ``n`` tokens greedily with EAGLE3 (``--speculative-num-steps steps``, top-k 1,
    ``steps + 1`` draft tokens). ``corrupt(draft)``, if given, runs on the draft's KV once the prompt's
    draft extend is done (what a prefill -> decode transfer hands over)."""
    cache = new_cache(target)
    nxt, feats = target_forward(target, prompt, cache)  # prefill
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
        verified, vfeats = target_forward(target, [seq[-1], *d], cache)  # verify
        m = 0
        while m < len(d) and d[m] == int(verified[m]):
            m += 1
        chain.proposed += len(d)
        chain.accepted += m
        chain.first_proposed += 1
        chain.first_accepted += m > 0
        if m < len(d):
            cache.crop(m - len(d))  # the target's KV of the rejected draft tokens
        new = [*d[:m], int(verified[m])]
        # draft extend over the verified positions base..base+m (drops the draft decode's rows)
        props, aux = draft.forward(new, vfeats[: m + 1], base)
        seq.extend(new)
    chain.tokens = seq[len(prompt): len(prompt) + n]
    return chain


#: the prompts' token counts: last pages of one token (49: ``<|assistant|>``), of the two closing
#: framing tokens (50), of one word and those two (67), and fuller ones
LENGTHS = [40, 49, 50, 57, 67, 75]
SPECULATE = 16  # tokens decoded per prompt with speculation



@torch.no_grad()
def page_changes(model: LlamaForCausalLM, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Greedy decode after the prompt's prefill, and again once per page of the prompt with that page's
    K and V zeroed in every layer (one batch row each): the reference output and, per page, how many of
    its tokens changed."""
    starts = range(0, len(prompt), PAGE)
    cache = new_cache(model)
    out = model(input_ids=torch.tensor([prompt] * (1 + len(starts))), past_key_values=cache, use_cache=True)
    for row, start in enumerate(starts, 1):
        for layer in cache.layers:
            layer.keys[row, :, start:start + PAGE] = 0
            layer.values[row, :, start:start + PAGE] = 0
    # the prefill's token (a prefill worker's) is the same in every row: the cache is read from the next on
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    decoded = []
    for _ in range(DECODE):
        tok = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        decoded.append(tok)
    outs = torch.cat(decoded, dim=1)
    return outs[0].tolist(), (outs[1:] != outs[0]).sum(dim=1).tolist()



def zero_state(draft: Eagle3Draft) -> None:
    draft.k[:] = [torch.zeros_like(t) for t in draft.k]
    draft.v[:] = [torch.zeros_like(t) for t in draft.v]


def rates(kv, draft_dir: Path, steps: int, state=None) -> tuple[float, float, list[list[int]]]:
    """Acceptance over the prompts (accepted / proposed draft tokens; the first draft token's alone)
    and the decoded tokens. ``state(i)`` gives the corruption of prompt i's draft KV, if any."""
    acc = prop = first_acc = first_prop = 0
    outs = []
    for i, prompt in enumerate(kv["prompts"]):
        chain = speculate(kv["target"], load_draft(draft_dir, kv["embed"]), prompt, SPECULATE, steps,
                           None if state is None else state(i))
        acc, prop = acc + chain.accepted, prop + chain.proposed
        first_acc, first_prop = first_acc + chain.first_accepted, first_prop + chain.first_proposed
        outs.append(chain.tokens)
    return acc / prop, first_acc / first_prop, outs


def other_prompts_state(kv):
    """Prompt i's draft KV replaced by that of another prompt of the same length (its draft extend)."""
    others = chat_prompts(kv["dir"], LENGTHS, seed=99)

    def state(i: int):
        other = load_draft(kv["agree"], kv["embed"])
        cache = new_cache(kv["target"])
        nxt, feats = target_forward(kv["target"], others[i], cache)
        other.forward([*others[i][1:], int(nxt[-1])], feats, 0)

        def swap(draft: Eagle3Draft) -> None:
            assert len(draft.k) == len(other.k)
            draft.k[:], draft.v[:] = list(other.k), list(other.v)
        return swap
    return state
