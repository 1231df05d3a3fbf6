"""The gateway's tokenizer: loaded from the directory the executor names in ModelInfo."""
from __future__ import annotations


def load_tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as e:  # transformers raises many kinds here
        raise RuntimeError(f"cannot load the tokenizer from {tokenizer_dir}: {e}") from e
