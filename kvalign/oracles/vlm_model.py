"""A tiny Qwen2-VL model directory built offline, read by both Dynamo's frontend and SGLang.

Multimodal alignment needs a vision-language model that both sides recognise with no model hub:

* Dynamo 1.6.1's frontend computes its multimodal routing tokens only for model families its
  ``llm-multimodal`` registry knows (``qwen2-vl`` among them, read from ``config.json``'s
  ``model_type``), counting each image's placeholder tokens from ``preprocessor_config.json``;
* SGLang 0.5.23 picks ``QwenVLImageProcessor`` for ``Qwen2VLForConditionalGeneration`` and runs
  HF's ``Qwen2VLImageProcessor`` (PIL, numpy, torchvision's Python part) on CPU.

The directory has what those two read, and nothing else (the live layer adds random weights,
:mod:`kvalign.live.engines.vlm_engine_model`):

* a *byte-level word* tokenizer: Qwen's own tokenizer is byte-level BPE, and SGLang's processor
  decodes a token-id prompt back to text and re-encodes it, so a tokenizer whose decode/encode does
  not round-trip would change the prompt on the engine side alone. One token per word (``Ġ`` marks
  a preceding space, as in GPT-2/Qwen) keeps token counts predictable;
* Qwen2-VL's special tokens and a chat template that renders an image part as
  ``<|vision_start|><|image_pad|><|vision_end|>``, as Qwen2-VL's template does;
* small image bounds (``min_pixels`` 56x56, ``max_pixels`` 64 patches of 28x28), so an image
  costs 4 to 64 placeholder tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>", "<unk>"]
#: Plain words; each has two ids, the word and ``Ġword`` (after a space).
WORDS = ("ok the quick brown fox jumps over lazy dog a rabbit ran across green field under bright morning "
         "sun while birds sang in tall trees near quiet river and small stones lay along its bank user "
         "assistant system describe this image picture compare these two what is").split()
#: Id 0 is a plain word: the live model's zeroed LM head always emits id 0 (see the live layer).
LEADING_WORD = WORDS[0]

MODEL_NAME = "kvalign-tiny-vl"
VOCAB_SIZE = 512
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
#: M-RoPE sections (temporal, height, width) in rotary pairs: they sum to HEAD_DIM / 2.
MROPE_SECTION = [2, 3, 3]
PATCH, MERGE, TEMPORAL_PATCH = 14, 2, 2
#: One placeholder token per MERGE x MERGE patches, so per FACTOR x FACTOR pixels.
FACTOR = PATCH * MERGE
MIN_PIXELS, MAX_PIXELS = 56 * 56, FACTOR * FACTOR * 64
VISION = {"depth": 1, "embed_dim": 32, "mlp_ratio": 2, "num_heads": 2, "in_chans": 3, "hidden_size": HIDDEN,
          "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL_PATCH}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}"
    "{% if message['content'] is string %} {{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %} {{ part['text'] }}"
    "{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def vocab() -> dict[str, int]:
    """Token string -> id: the leading word, the special tokens, the words, then ``Ġ`` + each word."""
    order = [LEADING_WORD, *SPECIAL, *WORDS[1:], *("\u0120" + w for w in WORDS)]
    return {tok: i for i, tok in enumerate(order)}


def token_id(token: str) -> int:
    """The id of one vocabulary token (a special token or a word)."""
    return vocab()[token]


def build_tokenizer():  # -> tokenizers.Tokenizer (imported lazily: not every command needs it)
    """The byte-level word tokenizer (exact decode/encode round trip, one id per word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    return tok


def config() -> dict:
    """``config.json``: Qwen2-VL's shape keys at the tiny sizes, and its multimodal token ids."""
    v = vocab()
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "_name_or_path": MODEL_NAME,
        "vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "max_window_layers": LAYERS, "sliding_window": 4096, "use_sliding_window": False,
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": v["<|endoftext|>"], "eos_token_id": v["<|im_end|>"],
        "vision_start_token_id": v["<|vision_start|>"], "vision_end_token_id": v["<|vision_end|>"],
        "vision_token_id": v["<|image_pad|>"], "image_token_id": v["<|image_pad|>"],
        "video_token_id": v["<|video_pad|>"],
        "rope_scaling": {"type": "mrope", "mrope_section": MROPE_SECTION},
        "vision_config": dict(VISION),
    }


def preprocessor_config() -> dict:
    """``preprocessor_config.json``: what both sides count image placeholder tokens from."""
    return {
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": PATCH, "temporal_patch_size": TEMPORAL_PATCH, "merge_size": MERGE,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
    }


def write_vlm_dir(path: str | Path, *, extra_config: dict | None = None) -> Path:
    """Write the tokenizer, configs and chat template into ``path`` (created if missing); return it."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    v = vocab()
    build_tokenizer().save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": "<unk>", "model_max_length": 4096, "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
        "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
    }, indent=1))
    (root / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (root / "config.json").write_text(json.dumps({**config(), **(extra_config or {})}, indent=1))
    (root / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=1))
    (root / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": v["<|im_end|>"], "pad_token_id": v["<|endoftext|>"], "max_new_tokens": 16}))
    return root
