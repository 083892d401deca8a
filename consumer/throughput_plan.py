"""Each drafter's stage for the throughput plan (common/throughput_plan.py): one replica's forward, backward and
share of the optimizer step and gradient all-reduce, per batch.

The shapes are the memory plan's (consumer/memory_plan.py): DrafterArch from the target's config and the
drafter's settings; the batch is tokens_per_batch context tokens in samples of --sample-tokens, each drawing
anchors_per_seq anchors up to the batch's anchor budget (consumer/objective.py). The optimizer's matrices are
the real split (consumer/optim.py's is_muon_param over the drafter built on the meta device). Newton–Schulz is
split over the replicas (consumer/muon.py): a replica's share is the busiest replica's FLOPs under the real
owner assignment, and the exchange is the bytes that replica receives in bf16. A step covers
max(1, tokens_per_step / tokens_per_batch) batches of the group, so the step's parts are divided by the
batches a replica trains in it.

    python -m consumer throughput-plan JOB [--target-config DIR] [--sample-tokens N]     one JSON line a drafter
"""

from __future__ import annotations

import math

import torch

from common.config import DrafterConfig, JobConfig
from common.flop_model import (
    ELEMENTWISE_BYTES_PER_PARAM,
    DrafterBatch,
    DrafterShapes,
    batch_anchors,
    drafter_flops,
    newton_schulz_flops,
    ring_allreduce_bytes,
)
from common.role_plans import plan_command
from common.throughput_plan import Work
from consumer.memory_plan import read_config
from consumer.model import DrafterArch
from consumer.muon import TRANSFER_DTYPE, assign_owners
from consumer.objective import anchor_budget


def drafter_shapes(arch: DrafterArch, cfg: DrafterConfig, vocab: int) -> DrafterShapes:
    return DrafterShapes(
        hidden=arch.hidden_size,
        heads=arch.num_heads,
        kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        intermediate=arch.intermediate_size,
        num_features=arch.num_features,
        vocab=vocab,
        block_size=cfg.block_size,
        layer_windows=tuple(arch.layer_window(i) for i in range(arch.num_layers)),
    )


def trained_matrices(arch: DrafterArch, cfg: DrafterConfig, vocab: int) -> tuple[int, list[tuple[int, int]]]:
    """(trainable parameters, the shapes Muon orthogonalises) of the drafter as the trainer builds it."""
    from consumer.dflash2 import make_drafter
    from consumer.optim import is_muon_param

    with torch.device("meta"):
        frozen = torch.empty(vocab, arch.hidden_size)
        model = make_drafter(cfg, arch, frozen, frozen, 0)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [tuple(p.shape) for n, p in named if cfg.optimizer == "muon" and is_muon_param(n, p)]
    return sum(p.numel() for _, p in named), muon


def muon_split(shapes: list[tuple[int, int]], steps: int, replicas: int, fsdp: bool) -> tuple[float, float]:
    """(Newton–Schulz FLOPs, bytes received) of the busiest replica in one step of the split (consumer/muon.py).
    Replicated weights: a replica receives every O it does not own. FSDP: an owner receives the other
    replicas' rows of each U it owns, and every replica its rows of each O it does not own."""
    costs = [newton_schulz_flops([s], steps) for s in shapes]
    owners = assign_owners(costs, replicas)
    size = torch.finfo(TRANSFER_DTYPE).bits // 8
    flops, received = [0.0] * replicas, [0.0] * replicas
    for (a, b), cost, owner in zip(shapes, costs, owners, strict=True):
        flops[owner] += cost
        for r in range(replicas):
            if r == owner:
                received[r] += a * b * size * (replicas - 1) / replicas if fsdp else 0.0
            else:
                received[r] += a * b * size / (replicas if fsdp else 1)
    return max(flops), max(received)


def drafter_work(job: JobConfig, d: DrafterConfig, arch: DrafterArch, vocab: int, sample_tokens: int) -> Work:
    tokens, R = job.data.tokens_per_batch, d.replicas
    budget = anchor_budget(tokens, d.anchors_per_batch, d.anchors_per_seq)
    anchors = batch_anchors(budget, tokens, sample_tokens, d.anchors_per_seq)
    flops = drafter_flops(drafter_shapes(arch, d, vocab), DrafterBatch(tokens, anchors, sample_tokens))
    params, muon = trained_matrices(arch, d, vocab)
    per_step = max(1.0, math.ceil(d.tokens_per_step / tokens) / R) if d.tokens_per_step else 1.0  # batches
    fsdp = R > 1 and d.distributed == "fsdp"
    ns_flops, exchange = muon_split(muon, d.muon_ns_steps, R, fsdp) if muon else (0.0, 0.0)
    parts = {
        "forward": ("flops", flops["forward"]),
        "backward": ("flops", flops["backward"]),
        "optimizer": ("flops", ns_flops / per_step),
        "optimizer state": ("hbm", ELEMENTWISE_BYTES_PER_PARAM * params / per_step),
    }
    if exchange:
        parts["optimizer exchange"] = ("nvlink", exchange / per_step)
    grads = 4 * params  # fp32 gradients
    if fsdp:  # all-gather the weights for forward and backward, reduce-scatter once
        parts["FSDP gathers"] = ("nvlink", ring_allreduce_bytes(grads, R))
        parts["gradient reduce"] = ("nvlink", ring_allreduce_bytes(grads, R) / 2 / per_step)
    elif R > 1:
        parts["gradient all-reduce"] = ("nvlink", ring_allreduce_bytes(grads, R) / per_step)
    note = (
        f"block {d.block_size}, {arch.num_layers} layers, {anchors} anchors = {anchors * d.block_size:,} query rows"
        f" a batch, {params / 1e9:.2f} B trained parameters, {d.optimizer}"
        + (f" ({len(muon)} matrices, {d.muon_ns_steps} Newton–Schulz iterations each" if muon else "")
        + (f", split over {R} replicas)" if muon and R > 1 else ")" if muon else "")
        + f", a step every {per_step:g} batch(es) a replica"
    )
    once_a_step = tuple(n for n in parts if n.startswith(("optimizer", "gradient")))
    return Work(f"drafter {d.name}", R, parts, note, per_step=per_step, step_parts=once_a_step)


def plan_works(job: JobConfig, config, sample_tokens: int) -> list[Work]:
    from consumer.target_parts import TargetParts, _dims

    text = config.get_text_config()
    dims = _dims(text, job.target.path)
    parts = TargetParts(path=job.target.path, tie_word_embeddings=False, embed_tokens=None, lm_head=None, **dims)
    n = len(job.target.layer_ids) if job.target.layer_ids else job.target.num_features
    return [
        drafter_work(job, d, DrafterArch.from_target(parts, d, n), dims["vocab_size"], sample_tokens)
        for d in job.drafters
    ]


DESCRIPTION = "each drafter's work per batch on one replica (common/throughput_plan.py)"


def main(argv: list[str]) -> int:
    """`python -m consumer throughput-plan JOB [--target-config DIR] [--sample-tokens N]`: a JSON line a drafter."""
    return plan_command("consumer", "throughput-plan", argv, DESCRIPTION, read_config, work=plan_works)
