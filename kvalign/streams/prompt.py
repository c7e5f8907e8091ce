"""Loading the prompt to diagnose: token ids from JSON, or text through a local tokenizer.

The router hashes token ids, so ids are the ground truth; text is accepted only with a local
Hugging Face tokenizer directory (never a hub download: a diagnosis must not depend on the network,
and the tokenizer must be the deployment's own, or the ids — and every hash — differ).
"""

from __future__ import annotations

import json
import os

from kvalign.errors import UsageError
from kvalign.model.hashing import as_u32_tokens


def _read(path: str, mode: str) -> str | bytes:
    try:
        with open(path, mode, **({"encoding": "utf-8"} if mode == "r" else {})) as f:
            return f.read()
    except FileNotFoundError:
        raise UsageError(f"prompt file {path} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"prompt file {path} is a directory") from None
    except UnicodeDecodeError:
        raise UsageError(f"prompt file {path} is not UTF-8 text") from None
    except OSError as exc:
        raise UsageError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None


def token_ids_from_json(path: str) -> list[int]:
    """A JSON list of token ids (or an object with ``token_ids`` / ``input_ids``)."""
    text = _read(path, "rb")
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise UsageError(f"prompt file {path} is not JSON token ids (for text, pass --tokenizer DIR)") from None
    if isinstance(data, dict):
        data = data.get("token_ids", data.get("input_ids"))
    if not isinstance(data, list):
        raise UsageError(f"prompt file {path} must hold a JSON list of token ids")
    for pos, t in enumerate(data):
        if isinstance(t, bool) or not isinstance(t, int):
            raise UsageError(f"prompt token at position {pos} is not an integer: {t!r}")
    try:
        as_u32_tokens(data)
    except ValueError as exc:
        raise UsageError(f"prompt {exc}") from None
    return data


def token_ids_from_text(path: str, tokenizer_dir: str) -> list[int]:
    """Tokenize a text file with the tokenizer in ``tokenizer_dir`` (offline only)."""
    if not os.path.isdir(tokenizer_dir):
        raise UsageError(f"tokenizer directory {tokenizer_dir} does not exist")
    text = _read(path, "r")
    tokenizer_json = os.path.join(tokenizer_dir, "tokenizer.json")
    if os.path.isfile(tokenizer_json):
        from tokenizers import Tokenizer

        try:
            return list(Tokenizer.from_file(tokenizer_json).encode(str(text)).ids)
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise UsageError(f"cannot use the tokenizer in {tokenizer_dir}: {exc}") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as exc:  # missing files surface as OSError/ValueError/ImportError in turn
        raise UsageError(f"no usable tokenizer in {tokenizer_dir}: {str(exc).splitlines()[0]}") from None
    return list(tok(str(text))["input_ids"])


def load_prompt(path: str, tokenizer_dir: str | None = None) -> list[int]:
    """The prompt's token ids, validated for the router (u32)."""
    return token_ids_from_text(path, tokenizer_dir) if tokenizer_dir else token_ids_from_json(path)
