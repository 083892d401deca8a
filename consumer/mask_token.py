"""Which embedding row the drafter's MASK token uses (dflash.md §1: a row of the target's embedding).

In order: the configured id; the tokenizer's own mask token; the first spare row (an embedding row no
token of the tokenizer uses: Qwen3's 151669, the id z-lab's `<|MASK|>` gets); else a reserved special
token the tokenizer declares but never produces (Llama 3's `<|reserved_special_token_0|>`, Gemma's
`<unused0>`, gpt-oss's `<|reserved_200000|>`). A target without tokenizer files gets the last row.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

RESERVED = [re.compile(p, re.IGNORECASE) for p in (r"mask", r"reserved", r"unused")]  # in order of preference
DEFAULT_MASK_TOKEN = "<|MASK|>"  # z-lab's token, and SGLang's default dflash_config.mask_token


def resolve_mask_token_id(path: str | Path, vocab_size: int, configured: int | None) -> int:
    if configured is None:
        configured = _from_tokenizer(Path(path), vocab_size)
    mask_id = vocab_size - 1 if configured is None else configured
    if not 0 <= mask_id < vocab_size:
        raise ValueError(
            f"mask_token_id {mask_id} is outside the target's embedding matrix (vocab_size {vocab_size});"
            " the MASK embedding must be a row of the target's embedding"
        )
    return mask_id


def _from_tokenizer(path: Path, vocab_size: int) -> int | None:
    if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.mask_token_id is not None and tok.mask_token_id < vocab_size:
        return tok.mask_token_id
    if len(tok) < vocab_size:
        return len(tok)  # ids 0..len-1 are the tokenizer's; the rows after them are spare
    in_use = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    added = sorted((i, str(t)) for i, t in tok.added_tokens_decoder.items() if i < vocab_size and i not in in_use)
    for pattern in RESERVED:
        for i, text in added:
            if pattern.search(text):
                return i
    raise ValueError(
        f"{path}: the tokenizer uses every row of the embedding (vocab_size {vocab_size}) and declares no mask,"
        " reserved or unused special token; set mask_token_id in the job's [[drafters]] table to a row the"
        " target never produces"
    )


@functools.lru_cache(maxsize=16)
def mask_token_text(path: str, mask_id: int) -> str:
    """The token string exported as dflash_config.mask_token for `mask_id` (SGLang's loader reads it, with
    "<|MASK|>" as its default, and refuses a drafter whose mask_token the tokenizer maps to another id than
    mask_token_id). An id the tokenizer has: its own string; a spare row (an id past the tokenizer, e.g.
    Qwen3's 151669): "<|MASK|>", the token z-lab adds there, unless the tokenizer already has that string
    elsewhere, then a name it does not have. A target without tokenizer files: "<|MASK|>"."""
    root = Path(path)
    if not (root / "tokenizer_config.json").is_file() and not (root / "tokenizer.json").is_file():
        return DEFAULT_MASK_TOKEN
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    vocab = tok.get_vocab()
    if mask_id < len(tok):
        text = tok.convert_ids_to_tokens(mask_id)
        if isinstance(text, str) and vocab.get(text) == mask_id:
            return text
    if DEFAULT_MASK_TOKEN not in vocab:
        return DEFAULT_MASK_TOKEN
    return f"<|dflash_mask_{mask_id}|>"
