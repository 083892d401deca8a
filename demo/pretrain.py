"""Pretrain the demo's tiny Qwen3 target on the chat corpus, on the CPU, for a fixed number of steps.

Plain torch (nanoGPT style): documents rendered with the chat template are concatenated into one token
stream; a batch is `batch_size` windows that each start at a document boundary; the loss covers the
assistant tokens only (the prompts are random, the answers are what the target must be sure of).
The run is a function of (corpus, seed, steps, torch threads) alone: the learning-rate schedule runs on
steps, the windows come from a seeded RNG, and the caller fixes the thread count (a different count sums
the matmuls in another order, which changes the weights). Wall time never decides what is trained.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from demo.tiny import build_tiny_target
from producer.data import ChatEncoder


@dataclass(frozen=True)
class TargetShape:
    """The tiny target's dimensions (Qwen3)."""

    hidden_size: int = 128
    num_layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384


@dataclass(frozen=True)
class PretrainResult:
    path: Path
    steps: int
    tokens: int  # tokens seen (inputs), loss-bearing or not
    seconds: float
    final_loss: float  # mean over the last logging window


def pack_corpus(encoder: ChatEncoder, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One stream of every conversation: (ids [N], loss mask [N], document start offsets).

    Masks come from the producer's ChatEncoder, so the target trains on exactly the answer tokens the
    drafter pipeline will later mask as answers.
    """
    ids: list[int] = []
    mask: list[int] = []
    starts: list[int] = []
    for rec in records:
        doc_ids, doc_mask, _ = encoder.encode(rec["messages"])
        starts.append(len(ids))
        ids += doc_ids
        mask += doc_mask
    return torch.tensor(ids), torch.tensor(mask, dtype=torch.bool), starts


def _lr_at(progress: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warmup, then cosine down to floor·peak; progress ∈ [0, 1] of the run."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def pretrain_target(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    records: list[dict],
    *,
    shape: TargetShape = TargetShape(),
    seq_len: int = 384,
    batch_size: int = 8,
    lr: float = 3e-3,
    steps: int = 2000,
    seed: int = 0,
    log_every: int = 50,
) -> PretrainResult:
    """Build a random target in `out_dir`, train it for exactly `steps` optimizer steps, save it.

    The directory then holds a standard HF checkpoint plus the tokenizer: loadable by
    `from_pretrained(out_dir, local_files_only=True)` like any downloaded model.
    """
    out = build_tiny_target(
        out_dir,
        tokenizer,
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        seed=seed,
    )
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    model.train()
    ids, mask, starts = pack_corpus(ChatEncoder(tokenizer, max_length=seq_len), records)
    if len(ids) < seq_len + 1:
        raise ValueError(f"pretrain_target: corpus has {len(ids)} tokens, fewer than seq_len+1={seq_len + 1}")
    starts = [s for s in starts if s + seq_len + 1 <= len(ids)] or [0]
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    rng = random.Random(seed)
    t0 = time.perf_counter()
    window_loss, window_n, final_loss, step = 0.0, 0, float("nan"), 0
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = _lr_at(step / steps, lr)
        offs = [rng.choice(starts) for _ in range(batch_size)]
        x = torch.stack([ids[o : o + seq_len] for o in offs])  # [b, L]
        y = torch.stack([ids[o + 1 : o + seq_len + 1] for o in offs])  # [b, L]
        y = y.masked_fill(~torch.stack([mask[o + 1 : o + seq_len + 1] for o in offs]), -100)
        logits = model(input_ids=x).logits  # [b, L, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        window_loss += loss.item()
        window_n += 1
        if step % log_every == 0:
            final_loss = window_loss / window_n
            dt = time.perf_counter() - t0
            print(
                f"pretrain: step {step} loss {final_loss:.4f} lr {opt.param_groups[0]['lr']:.2e}"
                f" {step * batch_size * seq_len / dt:.0f} tok/s {dt:.0f}s (of {steps} steps)",
                file=sys.stderr,
                flush=True,
            )
            window_loss, window_n = 0.0, 0
    if window_n:
        final_loss = window_loss / window_n
    seconds = time.perf_counter() - t0
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return PretrainResult(out, step, step * batch_size * seq_len, seconds, final_loss)


@torch.no_grad()
def greedy_accuracy(model, tokenizer: PreTrainedTokenizerBase, records: list[dict], batch_size: int = 64) -> dict:
    """Greedy answers of `model` on the records' prompts against their reference answers.

    Returns the exact-match rate, the token accuracy (reference tokens reproduced at their position)
    and the mean generated answer length in tokens (EOS included).
    """
    model.eval()
    encoder = ChatEncoder(tokenizer, max_length=1 << 20)
    pad = tokenizer.pad_token_id
    exact, tok_right, tok_total, gen_len = 0, 0, 0, 0
    for i in range(0, len(records), batch_size):
        refs = [encoder.encode(r["messages"])[:2] for r in records[i : i + batch_size]]
        prompts = [[t for t, m in zip(ids, msk, strict=True) if not m] for ids, msk in refs]
        answers = [[t for t, m in zip(ids, msk, strict=True) if m] for ids, msk in refs]
        width = max(len(p) for p in prompts)  # left padding: every prompt ends at the same column
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=max(len(a) for a in answers) + 4,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
        )
        for row, ans in zip(out[:, width:].tolist(), answers, strict=True):
            got = row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row
            exact += got == ans
            tok_right += sum(a == b for a, b in zip(got, ans, strict=False))
            tok_total += len(ans)
            gen_len += len(got)
    n = max(1, len(records))
    return {
        "exact_match": exact / n,
        "token_accuracy": tok_right / max(1, tok_total),
        "mean_answer_tokens": gen_len / n,
    }
