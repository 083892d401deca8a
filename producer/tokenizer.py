"""The producer's tokenizer: the target's own (or `data.tokenizer`'s), loaded from local files only.

A model directory without tokenizer files is a common download mistake (only the weights fetched); transformers
then tries to convert a slow tokenizer and advises installing sentencepiece or tiktoken, which helps nobody. So
the directory is checked first for the files a tokenizer is read from, and the error says which were looked for
and that `data.tokenizer` can name a directory that has them.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from producer.records import DataError

# what a tokenizer is read from: fast (tokenizer.json), its config, sentencepiece, BPE vocab/merges, tiktoken
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "*.tiktoken")


def load_tokenizer(path: str | Path, **kwargs) -> PreTrainedTokenizerBase:
    """AutoTokenizer for the local directory `path` (kwargs passed on); DataError naming the path when none."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(
            f"{path}: tokenizer directory does not exist; set data.tokenizer to one that holds the target's tokenizer"
        )
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise DataError(
            f"{path}: no tokenizer found (looked for {', '.join(TOKENIZER_FILES)}); copy the target's tokenizer"
            " files there, or set data.tokenizer to a directory that holds them"
        )
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: cannot load the tokenizer: {err}") from err
