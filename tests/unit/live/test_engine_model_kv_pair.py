"""The kv pair of :mod:`kvalign.live.engines.engine_model`: its target's output depends on every page
of the prompt's KV, and its EAGLE3 draft agrees with the target only when the draft's own KV is right.

Real libraries, no mocks: the target is transformers' ``LlamaForCausalLM`` (CPU, float32) loaded from
the written directory, the draft a reference of SGLang 0.5.23's EAGLE3 forward (:class:`Eagle3Draft`)
over the written draft safetensors, and both run greedy speculative chains as SGLang's EAGLE worker
does (draft extend over verified tokens, top-k 1 draft decode, target verify, longest prefix accepted).
Acceptance is measured, never forced.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
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


def _target(path: Path) -> LlamaForCausalLM:
    model = _transformers().LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def _cache(model: LlamaForCausalLM) -> DynamicCache:
    return _transformers().DynamicCache(config=model.config)


@torch.no_grad()
def _forward(model: LlamaForCausalLM, ids: list[int], cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy next ids after each of ``ids`` and SGLang's EAGLE3 aux features (aux layers [0, 1, 2]:
    the inputs of layers 1, 2, 3, i.e. ``hidden_states[1..3]``) at each, extending ``cache``."""
    out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in engine_model.AUX_LAYERS], dim=-1).float()
    return out.logits[0].argmax(-1), feats


def _greedy(model: LlamaForCausalLM, cache: DynamicCache, first: int, n: int) -> list[int]:
    out, tok = [], first
    for _ in range(n):
        nxt, _ = _forward(model, [tok], cache)
        tok = int(nxt[-1])
        out.append(tok)
    return out


def _prompts(target_dir: Path, lengths: list[int], seed: int = 1) -> list[list[int]]:
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


def _draft(draft_dir: Path, embed: torch.Tensor, dtype: torch.dtype = torch.float32) -> Eagle3Draft:
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
def _speculate(target: LlamaForCausalLM, draft: Eagle3Draft, prompt: list[int], n: int, steps: int,
               corrupt=None) -> Chain:
    """Decode ``n`` tokens greedily with EAGLE3 (``--speculative-num-steps steps``, top-k 1,
    ``steps + 1`` draft tokens). ``corrupt(draft)``, if given, runs on the draft's KV once the prompt's
    draft extend is done (what a prefill -> decode transfer hands over)."""
    cache = _cache(target)
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
        if m < len(d):
            cache.crop(m - len(d))  # the target's KV of the rejected draft tokens
        new = [*d[:m], int(verified[m])]
        # draft extend over the verified positions base..base+m (drops the draft decode's rows)
        props, aux = draft.forward(new, vfeats[: m + 1], base)
        seq.extend(new)
    chain.tokens = seq[len(prompt): len(prompt) + n]
    return chain


# --- fixtures -------------------------------------------------------------------------------------

#: the prompts' token counts: last pages of one token (49: ``<|assistant|>``), of the two closing
#: framing tokens (50), of one word and those two (67), and fuller ones
LENGTHS = [40, 49, 50, 57, 67, 75]
SPECULATE = 16  # tokens decoded per prompt with speculation


@pytest.fixture(scope="module")
def one_thread():
    """The models are tiny: torch's thread pool costs ten times the work on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def kv(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("kv-pair")
    target_dir, agree_dir = engine_model.write_models(root, "agree", pair="kv")
    _, disagree_dir = engine_model.write_models(root, "disagree", pair="kv")
    zero_target, _ = engine_model.write_models(root, "agree")
    target, prompts = _target(target_dir), _prompts(target_dir, LENGTHS)
    greedy = []  # the target's own greedy decode of each prompt (what speculation must reproduce)
    for prompt in prompts:
        cache = _cache(target)
        first = int(_forward(target, prompt, cache)[0][-1])
        greedy.append([first, *_greedy(target, cache, first, SPECULATE - 1)])
    return {"dir": target_dir, "target": target, "zero": _target(zero_target), "agree": agree_dir,
            "disagree": disagree_dir, "embed": target.model.embed_tokens.weight.detach(),
            "prompts": prompts, "greedy": greedy}


@torch.no_grad()
def _page_changes(model: LlamaForCausalLM, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Greedy decode after the prompt's prefill, and again once per page of the prompt with that page's
    K and V zeroed in every layer (one batch row each): the reference output and, per page, how many of
    its tokens changed."""
    starts = range(0, len(prompt), PAGE)
    cache = _cache(model)
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


# --- the tests ------------------------------------------------------------------------------------


def test_kv_target_output_depends_on_every_page(kv):
    """Every page of these prompts changes the next 10 tokens when its KV is zeroed. Not every page of
    every prompt does: one token turns the output by about a word, and over 300 random chat prompts of
    33-120 tokens (1,549 pages) 8 (0.5%) left 10 tokens as they were; these six lengths passed under
    each of the 11 prompt seeds tried."""
    v = engine_model.vocab(engine_model.LEADING_WORD)
    words = set(engine_model.plain_word_ids())
    for prompt in kv["prompts"]:
        assert prompt[0] == v["<|user|>"] and prompt[-2:] == [v["<|end|>"], v["<|assistant|>"]]
        ref, changed = _page_changes(kv["target"], prompt)
        print(f"kv target, {len(prompt)} tokens: output {ref}, tokens changed per zeroed page {changed}")
        assert set(ref) <= words  # always a plain word, never EOS
        assert len(set(ref)) > 1
        assert all(changed), f"a page whose KV was zeroed left the output as it was: {changed}"


def test_zero_head_target_output_ignores_the_kv(kv):
    """The negative control: the same check passes nothing on the zero-head target."""
    for prompt in kv["prompts"]:
        ref, changed = _page_changes(kv["zero"], prompt)
        assert ref == [0] * DECODE and not any(changed)


def _zero(draft: Eagle3Draft) -> None:
    draft.k[:] = [torch.zeros_like(t) for t in draft.k]
    draft.v[:] = [torch.zeros_like(t) for t in draft.v]


def _rates(kv, draft_dir: Path, steps: int, state=None) -> tuple[float, float, list[list[int]]]:
    """Acceptance over the prompts (accepted / proposed draft tokens; the first draft token's alone)
    and the decoded tokens. ``state(i)`` gives the corruption of prompt i's draft KV, if any."""
    acc = prop = first_acc = first_prop = 0
    outs = []
    for i, prompt in enumerate(kv["prompts"]):
        chain = _speculate(kv["target"], _draft(draft_dir, kv["embed"]), prompt, SPECULATE, steps,
                           None if state is None else state(i))
        acc, prop = acc + chain.accepted, prop + chain.proposed
        first_acc, first_prop = first_acc + chain.first_accepted, first_prop + chain.first_proposed
        outs.append(chain.tokens)
    return acc / prop, first_acc / first_prop, outs


def _other_prompts_state(kv):
    """Prompt i's draft KV replaced by that of another prompt of the same length (its draft extend)."""
    others = _prompts(kv["dir"], LENGTHS, seed=99)

    def state(i: int):
        other = _draft(kv["agree"], kv["embed"])
        cache = _cache(kv["target"])
        nxt, feats = _forward(kv["target"], others[i], cache)
        other.forward([*others[i][1:], int(nxt[-1])], feats, 0)

        def swap(draft: Eagle3Draft) -> None:
            assert len(draft.k) == len(other.k)
            draft.k[:], draft.v[:] = list(other.k), list(other.v)
        return swap
    return state


@pytest.mark.parametrize("steps", [1, 3], ids=["cpu-eagle-1-step", "gpu-eagle-3-steps"])
def test_kv_draft_agrees_only_with_its_own_state(kv, steps):
    """Measured agreement (draft token == the target's greedy token, verified by the target) with the
    draft's KV as its own draft extend wrote it, zeroed, and another prompt's. Measured when written
    (CPU float32, 1 / 3 steps): 1.00 right; 0.07 / 0.02 zeroed and 0.11 / 0.04 another prompt's —
    what the wrong states get right is mostly each prompt's first proposal, made by the prefill's
    draft extend before the state is replaced (as a prefill worker's is)."""
    right, right_first, outs = _rates(kv, kv["agree"], steps)
    zeroed, zeroed_first, zeroed_outs = _rates(kv, kv["agree"], steps, lambda i: _zero)
    other, other_first, other_outs = _rates(kv, kv["agree"], steps, _other_prompts_state(kv))
    print(f"kv draft, {steps} step(s): acceptance right {right:.3f} (first token {right_first:.3f}), "
          f"zeroed {zeroed:.3f} ({zeroed_first:.3f}), another prompt's {other:.3f} ({other_first:.3f})")
    assert outs == zeroed_outs == other_outs == kv["greedy"]  # greedy speculation is lossless: the chain is right
    assert right >= 0.95
    assert zeroed <= 0.3 and other <= 0.3
    assert right - max(zeroed, other) >= 0.6


def test_kv_pair_in_gpu_shapes(kv, tmp_path):
    """The GPU kind's shapes and dtype (bf16 weights, computed here in float32): the same two properties.
    (In bf16 arithmetic — transformers on CPU and this reference, not SGLang's CUDA kernels — the right
    state's agreement measured 1.00 / 0.99 (1 / 3 steps) with the float32 LM head the configs ask for,
    0.74 / 0.57 without: neighbouring words' bf16 logits tie.)"""
    target_dir, draft_dir = engine_model.write_models(tmp_path, "agree", engine_model.GPU, pair="kv")
    target = _target(target_dir)
    prompts = kv["prompts"][::2]
    for prompt in prompts:
        assert all(_page_changes(target, prompt)[1])
    gpu = {**kv, "target": target, "embed": target.model.embed_tokens.weight.detach(), "prompts": prompts}
    right, _, _ = _rates(gpu, draft_dir, 3)
    zeroed, _, _ = _rates(gpu, draft_dir, 3, lambda i: _zero)
    print(f"kv pair, GPU shapes: acceptance right {right:.3f}, zeroed {zeroed:.3f}")
    assert right >= 0.95 and zeroed <= 0.3


def test_kv_disagree_draft_is_never_accepted(kv):
    rate, _, _ = _rates(kv, kv["disagree"], 1)
    print(f"kv disagree draft: acceptance {rate:.3f}")
    assert rate <= 0.05


# --- what is written --------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


#: model.safetensors of the zero-head pair as engine_model wrote it before the kv pair existed
ZERO_HEAD_SHA256 = {
    ("float32", "target"): "2cc496ff90125555e0ef5efc23c33e235b688522ba5938ecbd5f0255b1d55802",
    ("float32", "agree"): "5b9cc0a88e9775783d3c808b5eab66c8db42d0a8884040d5fe939bb0338de6d2",
    ("float32", "disagree"): "29ab917c8e93ed7e730033caa74fe67ec884317914caf9c379723500c8a5f4ce",
    ("bfloat16", "target"): "ef3378a26c6135544f2584bbc181c806762b16e858c58cc40f034c11e8269a74",
    ("bfloat16", "agree"): "ce2f601fc2b0efbe397f73dfa13343a02876bb316c1f49b9225a7f66159334b8",
    ("bfloat16", "disagree"): "9b3174c72a56b4dca3f0536c0d3a07dbc3702f555543d19c38e1116c4b247c49",
}


@pytest.mark.parametrize("shapes", [engine_model.CPU, engine_model.GPU], ids=["cpu", "gpu"])
def test_zero_head_pair_is_unchanged_and_the_default(tmp_path, shapes):
    for draft in engine_model.DRAFTS:
        target, drafted = engine_model.write_models(tmp_path / draft, draft, shapes)
        assert (target.name, drafted.name) == ("target", f"draft-{draft}")
        assert _sha256(target / "model.safetensors") == ZERO_HEAD_SHA256[(shapes.dtype, "target")]
        assert _sha256(drafted / "model.safetensors") == ZERO_HEAD_SHA256[(shapes.dtype, draft)]
        assert json.loads((drafted / "kvalign-draft.json").read_text()) == {"draft": draft}
        assert json.loads((target / "config.json").read_text())["_name_or_path"] == engine_model.TARGET_NAME
    assert not engine_model.target_weights(shapes)["lm_head.weight"].any()
    assert not engine_model.draft_weights("agree", shapes)["lm_head.weight"].any()


@pytest.mark.parametrize("shapes", [engine_model.CPU, engine_model.GPU], ids=["cpu", "gpu"])
def test_kv_pair_is_written_beside_it(tmp_path, shapes):
    v = engine_model.vocab(engine_model.LEADING_WORD)
    target, drafted = engine_model.write_models(tmp_path, "agree", shapes, pair="kv")
    _, other = engine_model.write_models(tmp_path, "disagree", shapes, pair="kv")
    engine_model.write_models(tmp_path, "agree", shapes)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "draft-agree", "draft-kv-agree", "draft-kv-disagree", "target", "target-kv"]
    assert json.loads((drafted / "kvalign-draft.json").read_text()) == {"draft": "agree", "pair": "kv"}
    assert json.loads((other / "kvalign-draft.json").read_text()) == {"draft": "disagree", "pair": "kv"}
    tcfg, dcfg = (json.loads((d / "config.json").read_text()) for d in (target, drafted))
    assert tcfg["_name_or_path"] == "kvalign-tiny-llama-kv" and dcfg["_name_or_path"] == "kvalign-tiny-llama-kv-eagle3-agree"
    assert tcfg["rms_norm_eps"] == dcfg["rms_norm_eps"] == 1e-6 and dcfg["norm_output"] is True
    assert tcfg["hidden_size"] == shapes.hidden and tcfg["torch_dtype"] == shapes.dtype
    w = load_file(str(target / "model.safetensors"))
    d = load_file(str(drafted / "model.safetensors"))
    head = w["lm_head.weight"].float()
    words = engine_model.plain_word_ids()
    assert head[words].norm(dim=-1).min() > 0.9  # every plain word reachable...
    rest = torch.ones(engine_model.VOCAB, dtype=torch.bool)
    rest[words] = False
    assert not head[rest].any()  # ...and nothing else: EOS is never generated
    embed = w["model.embed_tokens.weight"]
    assert not embed[[v[t] for t in engine_model.KV_ZERO_EMBED]].any()
    assert torch.equal(embed[v["<|end|>"]], embed[v["<|assistant|>"]]) and embed[v["<|end|>"]].any()
    assert not w["model.layers.0.self_attn.q_proj.weight"].any() and not d["midlayer.self_attn.q_proj.weight"].any()
    assert not d["fc.weight"].any() and torch.equal(d["embed_tokens.weight"], embed)
    assert torch.equal(d["midlayer.self_attn.o_proj.weight"], w["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(d["lm_head.weight"].float() * engine_model.KV_DRAFT_NORM, head)


def test_unknown_pair_is_refused(tmp_path):
    with pytest.raises(ValueError, match="pair must be one of"):
        engine_model.write_models(tmp_path, "agree", pair="zero")  # type: ignore[arg-type]
