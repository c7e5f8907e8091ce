"""A tiny model directory built offline, so the real Dynamo frontend runs with no model hub.

``python -m dynamo.frontend`` loads the tokenizer, config and chat template of whatever model a
worker registers; a hub download would make CPU CI flaky and non-hermetic. This directory has
exactly what the frontend reads and nothing a GPU engine would need: a word-level tokenizer
built with the ``tokenizers`` library (one token per whitespace-separated word, so a prompt's
token count is predictable), a ``config.json``, and a chat template with fixed framing tokens.

Every scenario prompt is made of words from :data:`WORDS`; words outside the vocabulary map to
``<unk>`` (still one token each).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
UNK, BOS, EOS = 0, 1, 2

#: Plain words of the vocabulary (ids follow the special tokens, in this order).
WORDS = (
    "the quick brown fox jumps over lazy dog a rabbit ran across green field under bright "
    "morning sun while birds sang in tall trees near quiet river and small stones lay along "
    "its bank each one smooth grey cold wet test hello world kv cache block router worker "
    "prefill decode eagle bigram page token hash prefix match index event stream reply ok"
).split()

# One framing token before and after each message: the token count of a chat prompt is
# 2 * messages + words + 1 (the assistant generation prompt), independent of the wording.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' + message['content'] + ' <|end|> ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

MODEL_NAME = "kvalign-tiny"


def vocab(leading_word: str | None = None) -> dict[str, int]:
    """Token string -> id for the whole vocabulary (special tokens first).

    ``leading_word`` moves one word to id 0 (the real-engine model: its zeroed LM head always
    argmaxes to id 0, and a normal word there keeps the generated text visible).
    """
    if leading_word is None:
        order = [*SPECIAL, *WORDS]
    else:
        if leading_word not in WORDS:
            raise ValueError(f"{leading_word!r} is not a vocabulary word")
        order = [leading_word, *SPECIAL, *(w for w in WORDS if w != leading_word)]
    return {tok: i for i, tok in enumerate(order)}


def build_tokenizer(leading_word: str | None = None) -> Tokenizer:
    """The word-level tokenizer: whitespace split, one id per word, space-joined decode."""
    tok = Tokenizer(models.WordLevel(vocab(leading_word), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with single spaces
    tok.add_special_tokens(SPECIAL)
    return tok


def write_model_dir(path: str | Path, *, name: str = MODEL_NAME, leading_word: str | None = None,
                    config: dict | None = None) -> Path:
    """Write config, tokenizer and chat template into ``path`` (created if missing); return it.

    ``config`` overrides ``config.json`` keys (the real-engine model's shapes, see
    :mod:`kvalign.live.engines.engine_model`).
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    v = vocab(leading_word)
    bos, eos = v["<s>"], v["</s>"]
    build_tokenizer(leading_word).save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": 4096, "add_bos_token": False, "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (root / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=1))
    (root / "config.json").write_text(json.dumps({
        "_name_or_path": name,
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(v), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
        "bos_token_id": bos, "eos_token_id": eos, "tie_word_embeddings": True,
        **(config or {}),
    }, indent=1))
    (root / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos, "max_new_tokens": 64}, indent=1))
    return root
