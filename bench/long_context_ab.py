"""The long-context A/B on the demo (issue 30 §4): τ by context length before and after a YaRN stage 2.

    python -m bench.long_context_ab [--run-dir runs/long_context_ab] [--assets runs/demo/assets]
                                    [--short 48] [--long 96] [--factor 2] [--edges 24 48 72] [--eval-only]

The two-stage recipe of docs/recipes.md, shrunk to the demo (whose conversations are at most ~92 tokens):
stage 1 trains one block-16 drafter at data.max_length = --short (the demo's other keys, 2 epochs); stage 2
warm-starts two drafters from it (init_from: weights only) and trains them one epoch at data.max_length =
--long on the same data, one with YaRN (factor --factor, original_max_position_embeddings --short) and one
without (the control: the same fine-tune, the same batches of the same target forward, RoPE unchanged).
Each of the three is evaluated on the demo's held-out prompts with τ by context-length bucket (--edges, in
tokens of prompt + generated at each draft step). Writes RUN_DIR/long_context_ab.json and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.harness import write_job as write_job_file
from common.config import load_job
from demo.job import FULL, READY, job_doc, load_tokenizer, planned_batches

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16


def stage_job(run_dir: Path, assets: Path, max_length: int, epochs: int, drafters: dict[str, dict]) -> Path:
    """The demo's job at data.max_length = max_length, one block-16 drafter per entry of `drafters`."""
    if not (assets / READY).is_file():
        raise SystemExit(f"long_context_ab: {assets} holds no complete demo build ({READY} missing)")
    run_dir.mkdir(parents=True, exist_ok=True)
    link = run_dir / "assets"
    if not link.exists():
        link.symlink_to(assets.resolve(), target_is_directory=True)
    size = dataclasses.replace(FULL, max_length=max_length, epochs=epochs)
    tokenizer = load_tokenizer(assets / "tokenizer")
    report = {"train_batches": planned_batches(assets / "train.jsonl", tokenizer, size, 0, validation=None)}
    spec = tuple((name, BLOCK, extra) for name, extra in drafters.items())
    doc = job_doc(run_dir.resolve(), size, report, drafters_spec=spec)
    doc["job"]["name"] = run_dir.name
    doc["data"] = {
        k: v for k, v in doc["data"].items() if k not in ("validation", "eval_every", "validation_max_records")
    }
    return write_job_file(run_dir / "job.toml", doc)


def launch(job: Path) -> None:
    env = {**os.environ, "DFLASH_PLOTS": "0"}
    status = subprocess.run([str(ROOT / "launch.sh"), str(job)], env=env).returncode
    if status != 0:
        raise SystemExit(f"long_context_ab: launch.sh {job} exited {status}")


def evaluate(jobs: list[Path], edges: list[int], limit: int | None) -> dict[str, dict]:
    from evaluation.evaluate import format_report, run_eval  # late: training needs no evaluation code

    reports = {}
    for path in jobs:
        job = load_job(path)
        heldout = Path(job.job.run_dir) / "assets" / "heldout.jsonl"
        for d in job.drafters:
            ckpt = job.run_paths.checkpoints(d.name)
            report = run_eval(job.target.path, ckpt, heldout, limit=limit, max_new_tokens=160, bucket_edges=edges)
            print(format_report(report, d.name), flush=True)
            reports[d.name] = report.to_dict()
    return reports


def format_table(reports: dict[str, dict]) -> str:
    names = list(reports)
    labels = [b["label"] for b in reports[names[0]]["context_buckets"]]
    lines = [
        "| drafter | τ all | " + " | ".join(f"τ {lab}" for lab in labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for n in names:
        cells = [f"{b['tau']:.3f} ({b['steps']})" if b["steps"] else "- (0)" for b in reports[n]["context_buckets"]]
        lines.append(f"| {n} | {reports[n]['tau']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.long_context_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "long_context_ab")
    ap.add_argument("--assets", type=Path, default=ROOT / "runs" / "demo" / "assets")
    ap.add_argument("--short", type=int, default=48, help="stage 1's data.max_length")
    ap.add_argument("--long", type=int, default=96, help="stage 2's data.max_length")
    ap.add_argument("--factor", type=float, default=2.0, help="stage 2's YaRN factor")
    ap.add_argument("--edges", type=int, nargs="+", default=[24, 48, 72], help="context-length bucket edges")
    ap.add_argument("--limit", type=int, default=None, help="evaluate on the first N held-out prompts")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the trained drafters again")
    args = ap.parse_args(argv)
    s1_dir, s2_dir = args.run_dir / "stage1", args.run_dir / "stage2"
    yarn = {"rope_type": "yarn", "factor": args.factor, "original_max_position_embeddings": args.short}
    s1 = stage_job(s1_dir, args.assets, args.short, FULL.epochs, {"s1": {}})
    init = str((s1_dir / "checkpoints" / "s1").resolve())
    s2 = stage_job(
        s2_dir,
        args.assets,
        args.long,
        1,
        {"s2_yarn": {"init_from": init, "rope_scaling": yarn}, "s2_plain": {"init_from": init}},
    )
    if not args.eval_only:
        launch(s1)
        launch(s2)
    reports = evaluate([s1, s2], args.edges, args.limit)
    print(format_table(reports))
    out = {"short": args.short, "long": args.long, "factor": args.factor, "edges": args.edges, "reports": reports}
    (args.run_dir / "long_context_ab.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(r["lossless"] for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
