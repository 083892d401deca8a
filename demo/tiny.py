"""Small, fully local Hugging Face assets for tests and the demo job: nothing is ever downloaded.

`train_tokenizer` trains a byte-level BPE and gives it a chat template; `build_tiny_target` saves a random
Qwen3 causal LM next to that tokenizer, so the directory looks exactly like a downloaded model and every
loader in the project (`from_pretrained(dir, local_files_only=True)`) treats it as one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

MASK_TOKEN = "<|MASK|>"
PAD_TOKEN = "<|endoftext|>"
# Every tokenizer carries the special tokens of both templates, so one vocabulary serves either.
SPECIAL_TOKENS = [
    PAD_TOKEN,
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    MASK_TOKEN,
]

# Qwen style ChatML: the answer ends with <|im_end|>, then a newline the model never generates.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Llama-3 like: a BOS at the start, role headers, content trimmed, <|eot_id|> ends a turn with no newline.
LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

# name -> (template, end-of-turn token used as eos, bos token or None)
CHAT_TEMPLATES: dict[str, tuple[str, str, str | None]] = {
    "chatml": (CHATML_TEMPLATE, "<|im_end|>", None),
    "llama3": (LLAMA3_TEMPLATE, "<|eot_id|>", "<|begin_of_text|>"),
}


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: str | Path, template: str = "chatml"
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`, attach the named chat template, save it to `out_dir`.

    The vocabulary may come out smaller than `vocab_size` when the texts are short; use len(tokenizer).
    """
    if template not in CHAT_TEMPLATES:
        raise ValueError(f"unknown chat template {template!r}; choose one of {sorted(CHAT_TEMPLATES)}")
    chat_template, eos, bos = CHAT_TEMPLATES[template]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=eos,
        pad_token=PAD_TOKEN,
        bos_token=bos,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (eos, PAD_TOKEN, bos, MASK_TOKEN)],
    )
    tok.chat_template = chat_template
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    return tok


def build_tiny_target(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 6,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    vocab_size: int | None = None,
    device: str = "cpu",
) -> Path:
    """Save a random Qwen3ForCausalLM (safetensors) plus `tokenizer` to `out_dir`; returns the directory.

    `vocab_size` defaults to len(tokenizer); a larger one models a real vocabulary-to-hidden ratio.
    `device` other than the CPU initialises the weights there, directly in `dtype` (an 8B-shaped target
    in seconds, without 32 GB of float32 on the host).
    """
    vocab = vocab_size or len(tokenizer)
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    if device == "cpu":
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


_WORDS = [
    "the",
    "a",
    "model",
    "token",
    "draft",
    "block",
    "target",
    "layer",
    "hidden",
    "state",
    "train",
    "loss",
    "data",
    "batch",
    "slot",
    "ring",
    "queue",
    "fast",
    "slow",
    "small",
    "large",
    "river",
    "mountain",
    "city",
    "garden",
    "music",
    "number",
    "seven",
    "three",
    "blue",
    "green",
    "red",
    "quiet",
    "question",
    "answer",
    "explain",
    "why",
    "how",
    "what",
    "when",
    "because",
    "therefore",
    "however",
    "simple",
    "careful",
]


def synthetic_chats(n: int, seed: int = 0, max_turns: int = 3, max_words: int = 24) -> Iterator[dict]:
    """Deterministic multi-turn chat records ({"messages": [...]}) of varied length, for tests and the demo."""
    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, max_words))).capitalize() + "."

    for _ in range(n):
        messages = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, max_turns)):
            messages.append({"role": "user", "content": sentence()})
            messages.append({"role": "assistant", "content": " ".join(sentence() for _ in range(rng.randint(1, 3)))})
        yield {"messages": messages}


def corpus_texts(records: Iterable[dict]) -> Iterator[str]:
    """The plain texts of chat records, to train a tokenizer on."""
    for rec in records:
        for m in rec["messages"]:
            yield m["content"]


def write_jsonl(path: str | Path, records: Iterable[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return path
