"""The offline tiny model directory: what the Dynamo frontend loads, and predictable token counts."""

from __future__ import annotations

import json

from kvalign.live.cluster.model_dir import CHAT_TEMPLATE, EOS, SPECIAL, WORDS, write_model_dir
from kvalign.live.runs.scenario import BASE_TEXT, prefix_prompts, prompt_tokens


def test_files_and_config(tmp_path):
    root = write_model_dir(tmp_path / "m")
    assert {p.name for p in root.iterdir()} >= {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    cfg = json.loads((root / "config.json").read_text())
    assert cfg["vocab_size"] == len(SPECIAL) + len(WORDS) and cfg["eos_token_id"] == EOS
    assert json.loads((root / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert len(set(WORDS)) == len(WORDS)


def test_prompt_token_counts_follow_the_word_count(tmp_path):
    root = str(write_model_dir(tmp_path / "m"))
    base_words = len(BASE_TEXT.split())
    counts = [len(prompt_tokens(root, p)) for p in prefix_prompts(4)]
    assert counts == [base_words * (i + 1) + 3 for i in range(4)] == [21, 39, 57, 75]
    toks = prompt_tokens(root, "the quick zebra")
    assert toks[0] == SPECIAL.index("<|user|>") and toks[-1] == SPECIAL.index("<|assistant|>")
    assert toks[3] == SPECIAL.index("<unk>")  # out-of-vocabulary word: still one token
