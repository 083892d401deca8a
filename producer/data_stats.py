"""`python -m producer data-stats JOB.toml`: what a job's data holds and how many batches and steps it makes.

Indexes the data exactly as the producer does (same tokenizer, chat template kwargs, max_length, skips) and
plans the batches with the producer's own BatchPlan, so the numbers are the ones the job will see: records
read and skipped (by reason), a token-length histogram, the loss-token fraction, batches per epoch, and each
drafter's optimizer steps. Use it to size `tokens_per_batch` and `total_steps` before launching; it warns
when a drafter's `total_steps` (the length of its lr schedule) differs from the steps the plan makes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass

import numpy as np

from common.config import ConfigError, JobConfig, load_job
from producer.data import ChatDataset, DataError
from producer.plan import BatchPlan


@dataclass
class DrafterSteps:
    name: str
    replicas: int
    tokens_per_step: int
    planned_steps: int
    total_steps: int  # configured: the lr schedule's length
    leftover_tokens: int  # tokens of the plan's last step when they fall short of tokens_per_step (0: none short)


def planned_steps(batch_tokens: list[int], replicas: int, tokens_per_step: int) -> tuple[int, int]:
    """Optimizer steps the consumers take over batches of these sizes, in plan order, and the tokens of the
    last step when it falls short of `tokens_per_step` (0: it does not).

    As consumer/service.py counts them: a round is one batch per replica; the group steps after a round
    once `tokens_per_step` tokens were trained since its last step (0: after every round), and once more at
    the plan's end when batches short of a step remain (a partial last step).
    """
    steps, pending = 0, 0
    for first in range(0, len(batch_tokens), replicas):
        pending += sum(batch_tokens[first : first + replicas])
        if not tokens_per_step or pending >= tokens_per_step:
            steps, pending = steps + 1, 0
    return steps + (pending > 0), pending


def length_histogram(lengths: np.ndarray, max_length: int) -> list[tuple[int, int, int]]:
    """(low, high, count) buckets of token lengths: powers of two up to max_length."""
    edges = [1]
    while edges[-1] < max_length:
        edges.append(min(edges[-1] * 2, max_length))
    buckets = []
    for k in range(len(edges) - 1):
        low, high = edges[k] + (k > 0), edges[k + 1]
        buckets.append((low, high, int(((lengths >= low) & (lengths <= high)).sum())))
    return [b for b in buckets if b[2]] or [(1, max_length, 0)]


def collect(job: JobConfig, dataset: ChatDataset, plan: BatchPlan) -> dict:
    lengths = np.asarray(dataset.lengths, dtype=np.int64)
    stats = dataset.stats
    epochs = []
    batch_tokens: list[int] = []
    for e in range(plan.epochs):
        sizes = [int(lengths[list(ids)].sum()) for ids in plan.epoch_batches(e)]
        epochs.append(len(sizes))
        batch_tokens += sizes
    drafters = []
    for d in job.drafters:
        steps, left = planned_steps(batch_tokens, d.replicas, d.tokens_per_step)
        drafters.append(DrafterSteps(d.name, d.replicas, d.tokens_per_step, steps, d.total_steps, left))
    return {
        "data": job.data.path,
        "records": stats.records,
        "usable": len(dataset),
        "skipped": dict(stats.skipped),
        "truncated": stats.truncated,
        "max_length": job.data.max_length,
        "tokens": stats.tokens,
        "loss_tokens": stats.loss_tokens,
        "loss_fraction": stats.loss_tokens / max(stats.tokens, 1),
        "length_percentiles": {f"p{q}": int(np.percentile(lengths, q)) for q in (50, 90, 99)}
        | {"max": int(lengths.max())},
        "length_histogram": length_histogram(lengths, job.data.max_length),
        "tokens_per_batch": job.data.tokens_per_batch,
        "batches_per_epoch": epochs,
        "batches": len(batch_tokens),
        "batch_fill": sum(batch_tokens) / max(len(batch_tokens) * job.data.tokens_per_batch, 1),
        "sequences_per_batch": (len(dataset) * plan.epochs / max(len(batch_tokens), 1)) if batch_tokens else 0.0,
        "drafters": [asdict(d) for d in drafters],
    }


def schedule_warnings(report: dict) -> list[str]:
    out = []
    for d in report["drafters"]:
        planned, total = d["planned_steps"], d["total_steps"]
        if planned == total:
            continue
        effect = (
            f"the lr schedule would still be at {100 * planned / total:.0f}% of its length when the data ends"
            if planned < total
            else f"the last {planned - total} steps would run after the schedule ended (flat at its final lr)"
        )
        out.append(
            f"drafter {d['name']}: total_steps = {total} but the plan makes {planned} steps: {effect};"
            f" set total_steps = {planned}"
        )
    return out


def render(report: dict) -> str:
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(report["skipped"].items())) or "none"
    p = report["length_percentiles"]
    lines = [
        f"data {report['data']}",
        f"  records {report['records']}, usable {report['usable']}, skipped {skipped}",
        f"  truncated to max_length {report['max_length']}: {report['truncated']}",
        f"  tokens {report['tokens']}, loss tokens {report['loss_tokens']}"
        f" ({100 * report['loss_fraction']:.1f}% of tokens carry loss)",
        f"  sample length p50 {p['p50']}, p90 {p['p90']}, p99 {p['p99']}, max {p['max']}",
        "  token-length histogram:",
    ]
    peak = max(c for _, _, c in report["length_histogram"]) or 1
    for low, high, count in report["length_histogram"]:
        lines.append(f"    {low:>6}-{high:<6} {count:>8}  {'#' * max(1, round(40 * count / peak)) if count else ''}")
    lines += [
        f"plan: tokens_per_batch {report['tokens_per_batch']}, {len(report['batches_per_epoch'])} epoch(s),"
        f" batches per epoch {report['batches_per_epoch']}, {report['batches']} batches in all",
        f"  batches {100 * report['batch_fill']:.1f}% full on average,"
        f" {report['sequences_per_batch']:.1f} sequences per batch",
    ]
    for d in report["drafters"]:
        accum = f"tokens_per_step {d['tokens_per_step']}" if d["tokens_per_step"] else "one round a step"
        left = f", the last step partial: {d['leftover_tokens']} tokens" if d["leftover_tokens"] else ""
        lines.append(
            f"drafter {d['name']}: {d['planned_steps']} optimizer steps ({d['replicas']} replica(s), {accum}{left});"
            f" total_steps = {d['total_steps']}"
        )
    lines += [f"warning: {w}" for w in schedule_warnings(report)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from producer.build import build_dataset  # the producer's own indexing and plan

    ap = argparse.ArgumentParser(prog="python -m producer data-stats", description=__doc__.splitlines()[0])
    ap.add_argument("job", help="the job file (TOML)")
    ap.add_argument("--node-rank", type=int, default=0, help="the node whose shard to plan (multi-node jobs)")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON document instead of the text report")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    try:
        job = load_job(args.job)
        dataset, plan = build_dataset(job, args.node_rank, args.nnodes)
    except (ConfigError, DataError) as err:
        print(f"producer data-stats: {err}", file=sys.stderr)
        return 2
    report = collect(job, dataset, plan)
    print(json.dumps(report) if args.json else render(report), flush=True)
    if args.json:
        for w in schedule_warnings(report):
            print(f"warning: {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
