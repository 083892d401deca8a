"""Shared helpers of the drafter tests (no tests in here): a tiny Qwen3 target on disk and its features."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from common.config import DrafterConfig
from consumer.target_parts import TargetParts, load_target_parts

TINY = dict(
    hidden_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=256,
    initializer_range=0.2,  # sharper logits than 0.02, like a trained target's
)
LAYER_IDS = [1, 3, 5]


def tiny_target(path: Path, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random tiny Qwen3 target saved like a download (config.json + model.safetensors)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(path)
    return model


@torch.no_grad()
def target_features(model, seqs: list[torch.Tensor], layer_ids=LAYER_IDS) -> torch.Tensor:
    """Packed [T, n·H]: hidden_states[l+1] (the output of decoder layer l) per sequence, concatenated."""
    rows = []
    for ids in seqs:
        hs = model(ids[None], output_hidden_states=True).hidden_states
        rows.append(torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1))
    return torch.cat(rows)


def packed(seqs: list[torch.Tensor], prompt_len: int = 2):
    """input_ids [T], loss_mask [T] (0 on each sequence's first prompt_len tokens), cu_seqlens [nseq+1]."""
    ids = torch.cat(seqs)
    mask = torch.cat([(torch.arange(len(s)) >= prompt_len).to(torch.uint8) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return ids, mask, cu


def distinct_seqs(lengths: list[int], vocab: int = 500, seed: int = 1) -> list[torch.Tensor]:
    """Sequences of distinct tokens: each token determines what follows it (learnable by heart)."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    return list(perm[: sum(lengths)].split(lengths))


def parts_and_batch(path: Path, lengths: list[int]) -> tuple[TargetParts, tuple]:
    """A tiny target saved at `path`, the drafter's parts of it, and one packed batch of distinct sequences of
    `lengths` tokens: (features, ids, loss mask, cu_seqlens)."""
    model = tiny_target(path)
    seqs = distinct_seqs(lengths)
    return load_target_parts(path), (target_features(model, seqs), *packed(seqs))


def drafter_cfg(**overrides) -> DrafterConfig:
    base = dict(
        name="d0",
        block_size=4,
        num_layers=1,
        anchors_per_seq=8,
        loss_chunk_rows=256,
        lr=1e-2,
        warmup_frac=0.0,
        total_steps=1000,
        log_every=1,
        seed=0,
        optimizer="adamw",  # the drafter tests pin the objective under the plain optimizer; Muon has its own
    )
    return DrafterConfig(**{**base, **overrides})
