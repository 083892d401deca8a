"""The recipe A/B on the demo: one job, one drafter per (variant × block size), evaluated on the held-out set.

    python -m bench.recipe_ab [--run-dir runs/recipe_ab] [--assets runs/demo/assets] [--quick]
                              [--variants JSON] [--blocks 16 8] [--epochs N] [--limit N] [--features target|fp8]

Every drafter of one job trains on the same batches of the same target forward (the producer runs it once
for all), for the same steps, from the same seed: the variants differ only in their drafter keys. A variant
is a name and a dict of drafter-key overrides (VARIANTS; --variants '{"name": {...}}' replaces them), so a
new recipe (arch = "dflash2", a sliding-window rule) is one more entry. A row "block b" drafts b - 1 tokens
verified b wide whatever the head: a DSpark variant (its block_size counts drafted tokens) trains block b - 1.
The job is the demo's own (demo.job.job_doc, its assets via a link), run by launch.sh as real processes; the
evaluation is the demo's (demo.job.evaluate_demo: held-out τ, lossless check). Prints one table row per
drafter: variant, block, τ, Δτ against the first variant at that block, lossless, and its cost from its
consumer log (bench/ab_logs.py: compute ms per step, anchors and candidates per batch); writes
RUN_DIR/recipe_ab.json. --epochs N trains N passes over the data instead of the demo's 2 (a cheaper A/B; the
lr schedule follows). A job-wide key (--features: how the target features travel through the ring) is
compared by two runs of the same plan, one value each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.ab_logs import drafter_cost
from bench.harness import write_job as write_job_file
from demo.job import FULL, QUICK, READY, evaluate_demo, job_doc, load_tokenizer, planned_batches

ROOT = Path(__file__).resolve().parents[1]

# (a) the original recipe, (b) D-PACE, (c) D-PACE + Muon, (d) DFlash2 + D-PACE, (e) an all-sliding drafter
# (window 32) with its in-block rule both ways; the first is the baseline of the Δ column
SLIDING = {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 32}
VARIANTS: dict[str, dict] = {
    "decay_adamw": {"loss": "decay", "optimizer": "adamw"},
    "dpace_adamw": {"loss": "dpace", "optimizer": "adamw"},
    "dpace_muon": {"loss": "dpace", "optimizer": "muon"},
    "dflash2_dpace": {"arch": "dflash2", "loss": "dpace", "optimizer": "adamw"},
    "swa_causal": {**SLIDING, "sliding_block_attention": "causal", "loss": "dpace", "optimizer": "adamw"},
    "swa_bidir": {**SLIDING, "sliding_block_attention": "bidirectional", "loss": "dpace", "optimizer": "adamw"},
}


def drafter_name(variant: str, block: int) -> str:
    return f"{variant}_b{block}"


def trained_block(overrides: dict, block: int) -> int:
    """The block_size that drafts what a DFlash block of `block` drafts (block - 1 tokens, verified `block`
    wide): a DSpark block counts drafted tokens (every slot drafts), so its row "block 16" trains block 15."""
    return block - 1 if overrides.get("arch") == "dspark" else block


def write_job(
    run_dir: Path,
    assets: Path,
    variants: dict[str, dict],
    blocks: list[int],
    quick: bool,
    epochs: int | None = None,
    features: str = "target",
) -> Path:
    """The demo's job with one drafter per (variant, block), its assets linked into run_dir; `epochs`: passes
    over the data (None: the demo's); `features`: transport.features."""
    ready = assets / READY
    if not ready.is_file():
        raise SystemExit(
            f"recipe_ab: {assets} holds no complete demo build ({READY} missing): run"
            " `python -m demo prepare runs/demo` first"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    link = run_dir / "assets"
    if link.is_symlink() or link.exists():
        if link.resolve() != assets.resolve():
            raise SystemExit(f"recipe_ab: {link} exists and is not a link to {assets}")
    else:
        link.symlink_to(assets.resolve(), target_is_directory=True)
    spec = tuple(
        (drafter_name(v, b), trained_block(overrides, b), overrides)
        for v, overrides in variants.items()
        for b in blocks
    )
    size = QUICK if quick else FULL
    if epochs is not None:
        size = dataclasses.replace(size, epochs=epochs)
    # every drafter trains on all of train.jsonl (no data.validation split): the variants are compared by
    # decoding the held-out prompts (heldout.jsonl), and the rows stay comparable with runs made before the split
    report = json.loads(ready.read_text())
    if report.get("validation") is not None or epochs is not None:  # READY's count is of another plan
        tokenizer = load_tokenizer(assets / "tokenizer")
        report["train_batches"] = planned_batches(assets / "train.jsonl", tokenizer, size, 0, validation=None)
    doc = job_doc(run_dir.resolve(), size, report, drafters_spec=spec)
    doc["job"]["name"] = "recipe_ab"
    doc["transport"]["features"] = features
    doc["data"] = {
        k: v for k, v in doc["data"].items() if k not in ("validation", "eval_every", "validation_max_records")
    }
    return write_job_file(run_dir / "job.toml", doc)


def table(reports: dict[str, dict], variants: dict[str, dict], blocks: list[int], logs: Path) -> list[dict]:
    rows = []
    for b in blocks:
        base = None
        for v in variants:
            r = reports[drafter_name(v, b)]
            cost = drafter_cost(logs / f"consumer-{drafter_name(v, b)}-r0.log")
            base = r["tau"] if base is None else base
            rows.append(
                {
                    "variant": v,
                    "block": b,
                    "tau": r["tau"],
                    "delta": r["tau"] - base,
                    "delta_pct": 100.0 * (r["tau"] - base) / base,
                    "lossless": r["lossless"],
                    **dataclasses.asdict(cost),
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        "| variant | block | τ | Δτ vs first | lossless | ms/step | anchors/batch | candidates/batch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['block']} | {r['tau']:.3f} | {r['delta']:+.3f} ({r['delta_pct']:+.1f} %)"
            f" | {'yes' if r['lossless'] else 'NO'} | {r['ms_per_step']:.0f} | {r['anchors_per_batch']:.1f}"
            f" | {r['candidates_per_batch']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.recipe_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "recipe_ab")
    ap.add_argument("--assets", type=Path, default=ROOT / "runs" / "demo" / "assets")
    ap.add_argument("--quick", action="store_true", help="assets built by `demo prepare --quick`")
    ap.add_argument("--variants", type=json.loads, default=None, help='{"name": {drafter key: value}, ...}')
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 8])
    ap.add_argument("--epochs", type=int, default=None, help="passes over the data (default: the demo's 2)")
    ap.add_argument("--limit", type=int, default=None, help="evaluate on the first N held-out prompts")
    ap.add_argument("--features", choices=["target", "fp8"], default="target", help="transport.features")
    ap.add_argument("--timeout", type=float, default=4 * 3600.0, help="seconds the training job may take")
    args = ap.parse_args(argv)
    variants = args.variants or VARIANTS
    job = write_job(args.run_dir, args.assets, variants, args.blocks, args.quick, args.epochs, args.features)
    print(f"recipe_ab: {len(variants) * len(args.blocks)} drafters in {job}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "DFLASH_PLOTS": "0"}
    try:
        status = subprocess.run([str(ROOT / "launch.sh"), str(job)], env=env, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"recipe_ab: the job ran past {args.timeout:.0f} s (launch.sh was stopped)", file=sys.stderr)
        return 1
    train_s = time.perf_counter() - t0
    if status != 0:
        print(f"recipe_ab: launch.sh exited {status}; logs in {args.run_dir / 'logs'}", file=sys.stderr)
        return status
    reports, _ = evaluate_demo(job, limit=args.limit)
    rows = table(reports, variants, args.blocks, args.run_dir / "logs")
    print(format_table(rows))
    (args.run_dir / "recipe_ab.json").write_text(
        json.dumps(
            {
                "variants": variants,
                "rows": rows,
                "train_seconds": train_s,
                "eval_seconds": time.perf_counter() - t0 - train_s,
            },
            indent=2,
        )
        + "\n"
    )
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
