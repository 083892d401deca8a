"""Each drafter's stage for the throughput plan (common/throughput_plan.py): one replica's forward, backward and
share of the optimizer step and gradient all-reduce, per batch.

The shapes are the memory plan's (consumer/memory_plan.py): DrafterArch from the target's config and the
drafter's settings; the batch is tokens_per_batch context tokens in samples of --sample-tokens, each drawing
anchors_per_seq anchors up to the batch's anchor budget (consumer/objective.py). The optimizer's matrices are
the real split (consumer/optim.py's is_muon_param over the drafter built on the meta device); every replica
runs the whole Newton–Schulz today, once per step, and a step covers max(1, tokens_per_step / tokens_per_batch)
batches of the group.

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
from common.throughput_plan import Work
from consumer.model import DrafterArch
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


def drafter_work(job: JobConfig, d: DrafterConfig, arch: DrafterArch, vocab: int, sample_tokens: int) -> Work:
    tokens, R = job.data.tokens_per_batch, d.replicas
    budget = anchor_budget(tokens, d.anchors_per_batch, d.anchors_per_seq)
    anchors = batch_anchors(budget, tokens, sample_tokens, d.anchors_per_seq)
    flops = drafter_flops(drafter_shapes(arch, d, vocab), DrafterBatch(tokens, anchors, sample_tokens))
    params, muon = trained_matrices(arch, d, vocab)
    per_step = max(1.0, math.ceil(d.tokens_per_step / tokens) / R) if d.tokens_per_step else 1.0  # batches
    parts = {
        "forward": ("flops", flops["forward"]),
        "backward": ("flops", flops["backward"]),
        "optimizer": ("flops", newton_schulz_flops(muon, d.muon_ns_steps) / per_step),
        "optimizer state": ("hbm", ELEMENTWISE_BYTES_PER_PARAM * params / per_step),
    }
    grads = 4 * params  # fp32 gradients
    if R > 1 and d.distributed == "fsdp":  # all-gather the weights for forward and backward, reduce-scatter once
        parts["FSDP gathers"] = ("nvlink", ring_allreduce_bytes(grads, R))
        parts["gradient reduce"] = ("nvlink", ring_allreduce_bytes(grads, R) / 2 / per_step)
    elif R > 1:
        parts["gradient all-reduce"] = ("nvlink", ring_allreduce_bytes(grads, R) / per_step)
    note = (
        f"block {d.block_size}, {arch.num_layers} layers, {anchors} anchors = {anchors * d.block_size:,} query rows"
        f" a batch, {params / 1e9:.2f} B trained parameters, {d.optimizer}"
        + (f" ({len(muon)} matrices, {d.muon_ns_steps} Newton–Schulz iterations each)" if muon else "")
        + f", a step every {per_step:g} batch(es) a replica"
    )
    return Work(f"drafter {d.name}", R, parts, note)


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


def main(argv: list[str]) -> int:
    import argparse
    import sys

    from consumer.memory_plan import PlanInputError, plan_inputs

    ap = argparse.ArgumentParser(
        prog="python -m consumer throughput-plan",
        description="each drafter's work per batch on one replica (common/throughput_plan.py)",
    )
    ap.add_argument("job")
    ap.add_argument("--target-config", default=None, help="the target's model directory (default: target.path)")
    ap.add_argument("--sample-tokens", type=int, default=None, help="mean sample length (default: data.max_length)")
    args = ap.parse_args(argv)
    try:
        job, config = plan_inputs(args.job, args.target_config)
    except PlanInputError as err:
        print(f"consumer throughput-plan: {err}", file=sys.stderr)
        return 2
    sample = min(args.sample_tokens or job.data.max_length, job.data.tokens_per_batch)
    for w in plan_works(job, config, sample):
        print(w.to_json())
    return 0
