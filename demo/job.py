"""The embedded demo job: every asset built locally, then a job file that trains two drafters on it.

    python -m demo prepare RUN_DIR [--quick]     builds RUN_DIR/assets once, prints the job path
    python -m demo evaluate JOB.toml [--json]    speculative decoding with each trained drafter

Assets (RUN_DIR/assets/): corpus.jsonl (pretraining chats), prompts.jsonl (prompts the target never
saw, for the drafters), heldout.jsonl (evaluation prompts with their reference answers), tokenizer/ and
target/ (a byte-level BPE with a ChatML template and <|MASK|>; a tiny Qwen3 pretrained on the corpus),
train.jsonl (prompts.jsonl answered by the target: the drafters' data, as in the paper), READY (written
last: sizes and measurements; without it the assets are rebuilt from scratch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common import joblock
from common.accounting_check import read_records
from common.accounting_validation import held_out_curve
from common.checkpoint_pointer import BEST, read_pointer
from common.config import load_job
from common.job_file import job_text
from common.supervisor import watch_supervisor
from demo.corpus import generate_corpus, split_corpus
from demo.pretrain import TargetShape, greedy_accuracy, pretrain_target
from demo.tiny import train_tokenizer, write_jsonl
from producer.data import ChatEncoder
from producer.plan import BatchPlan
from producer.regenerate import regenerate
from producer.tokenizer import load_tokenizer
from producer.validation import excluded_ids

READY = "READY"
ASSETS_VERSION = 3  # bump when what the assets hold changes: older builds are rebuilt
BUILD_THREADS = 1  # torch threads of the build: a fixed count makes the assets the same on every machine
DEMO_GOAL_TAU = 3.0  # for the block-16 drafter


@dataclass(frozen=True)
class DemoSize:
    """Every size of the demo in one place; QUICK is the same pipeline shrunk to seconds for tests."""

    corpus: int = 60_000  # conversations drawn; ~85% pretrain the target, the rest are held out
    held_out: int = 64  # evaluation prompts: neither the target nor the drafters train on them
    regenerated: int = 5_000  # prompts the target never saw, answered by it: the drafters' data
    vocab: int = 1024
    shape: TargetShape = field(default_factory=lambda: TargetShape(num_layers=4))
    layer_ids: tuple[int, ...] = (1, 2, 3)  # target features fused by the drafters
    pretrain_steps: int = 2000  # fixed, so the target is the same whatever the machine's speed or load
    pretrain_batch: int = 4
    pretrain_seq: int = 256
    pretrain_lr: float = 8e-3
    max_new_tokens: int = 160  # regeneration; the longest template answer is ~100 tokens
    max_length: int = 256
    tokens_per_batch: int = 2048
    epochs: int = 2  # ~370 batches an epoch (half of them small remainders of mixed-task packing)
    drafter_layers: int = 2
    anchors_per_seq: int = 8
    drafter_lr: float = 3e-3


FULL = DemoSize()
QUICK = DemoSize(
    corpus=600,
    held_out=4,
    regenerated=16,
    vocab=300,
    shape=TargetShape(hidden_size=32, num_layers=4, heads=2, kv_heads=1, head_dim=16, intermediate_size=64),
    layer_ids=(1, 3),
    pretrain_steps=8,
    pretrain_batch=2,
    pretrain_seq=128,
    max_new_tokens=24,
    max_length=128,
    tokens_per_batch=512,
    epochs=1,
    drafter_layers=1,
    anchors_per_seq=4,
)


def log(msg: str) -> None:
    print(f"demo: {msg}", file=sys.stderr, flush=True)


def build_assets(assets: Path, size: DemoSize, seed: int = 0, threads: int = BUILD_THREADS) -> dict:
    """Build every asset into `assets` (emptied first) with `threads` torch threads; returns the
    measurements written to READY. Same (size, seed, threads) on the same CPU kernels (`cpu_kernels`)
    → byte-identical weights and data: the thread count is part of the recipe (it sets the order of every
    float sum), so it is fixed, not taken from the cores or the load. Another instruction set (AVX2 vs
    AVX-512, another BLAS path) sums in another order: its weights differ, and so do the figures."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    log(f"using {torch.get_num_threads()} torch thread(s), CPU kernels {cpu_kernels()}")
    try:
        return _build(assets, size, seed)
    finally:
        torch.set_num_threads(threads_before)


def cpu_kernels() -> str:
    """The CPU kernels the float sums run in (ATen's vector ISA, torch's version): another set sums in another
    order, so its assets, and every figure from them, differ from this one's (docs/demo.md)."""
    return f"{torch.backends.cpu.get_cpu_capability()} (torch {torch.__version__})"


def _build(assets: Path, size: DemoSize, seed: int) -> dict:
    t0 = time.perf_counter()
    if assets.exists():
        shutil.rmtree(assets)
    assets.mkdir(parents=True)
    train, prompts, held = split_corpus(generate_corpus(seed, size.corpus), size.held_out, size.regenerated)
    write_jsonl(assets / "corpus.jsonl", train)
    prompts.sort(key=lambda r: len(r["messages"][1]["content"]))  # regeneration batches of like lengths
    write_jsonl(assets / "prompts.jsonl", prompts)
    write_jsonl(assets / "heldout.jsonl", held)
    texts = [m["content"] for r in train for m in r["messages"]] + ["user", "assistant"]
    tokenizer = train_tokenizer(texts, size.vocab, assets / "tokenizer")
    log(
        f"{len(train)} pretraining chats, {len(prompts)} drafter prompts, {len(held)} held-out prompts;"
        f" tokenizer of {len(tokenizer)} tokens"
    )

    pre = pretrain_target(
        assets / "target",
        tokenizer,
        train,
        shape=size.shape,
        seq_len=size.pretrain_seq,
        batch_size=size.pretrain_batch,
        lr=size.pretrain_lr,
        steps=size.pretrain_steps,
        seed=seed,
    )
    log(f"target pretrained: {pre.steps} steps, {pre.tokens} tokens in {pre.seconds:.0f}s, loss {pre.final_loss:.4f}")
    target = AutoModelForCausalLM.from_pretrained(pre.path, local_files_only=True, dtype=torch.float32)
    t_acc = time.perf_counter()
    accuracy = greedy_accuracy(target, tokenizer, held)
    log(f"target greedy accuracy on held-out prompts: {accuracy}")
    accuracy_s = time.perf_counter() - t_acc

    t_regen = time.perf_counter()
    regen = regenerate(
        pre.path,
        assets / "prompts.jsonl",
        assets / "train.jsonl",
        batch_size=256,
        max_new_tokens=size.max_new_tokens,
        dtype="float32",
    )
    regen_s = time.perf_counter() - t_regen
    log(f"regenerated {regen.written} answers ({regen.new_tokens} tokens) in {regen_s:.0f}s")
    report = {
        "version": ASSETS_VERSION,
        "size": asdict(size),
        "seed": seed,
        "torch_threads": torch.get_num_threads(),
        "cpu_kernels": cpu_kernels(),
        "pretrain": {
            "steps": pre.steps,
            "tokens": pre.tokens,
            "seconds": pre.seconds,
            "loss": pre.final_loss,
        },
        "heldout_greedy": accuracy,
        "accuracy_seconds": accuracy_s,
        "regenerate": {"answers": regen.written, "new_tokens": regen.new_tokens, "seconds": regen_s},
        "train_batches": planned_batches(assets / "train.jsonl", tokenizer, size, seed),
        "validation": VALIDATION,
        "build_seconds": time.perf_counter() - t0,
    }
    (assets / READY).write_text(json.dumps(report, indent=2) + "\n")  # last: its presence means complete
    return report


LENGTH_GROUP_WINDOW = 1  # mixed-task batches: length-sorted windows made one-task batches and slowed learning
# data.validation: 2% of the drafters' data held out (100 records of the full demo), a pass of at most 64 of
# them every EVAL_EVERY batches and at the end: the held-out curve of the plots and checkpoints/<drafter>/best
VALIDATION = 0.02
EVAL_EVERY = 60
VALIDATION_MAX_RECORDS = 64


def planned_batches(path: Path, tokenizer, size: DemoSize, seed: int, validation: float | None = VALIDATION) -> int:
    """How many batches the producer's plan makes of the drafters' data (the held-out split `validation`
    left out): the lr schedule's length."""
    encoder = ChatEncoder(tokenizer, size.max_length)
    with path.open() as f:
        lengths = [len(encoder.encode(json.loads(line)["messages"])[0]) for line in f]
    plan = BatchPlan(
        lengths,
        seed,
        size.epochs,
        size.tokens_per_batch,
        LENGTH_GROUP_WINDOW,
        exclude=excluded_ids(validation, len(lengths), seed),
    )
    return sum(len(plan.epoch_batches(e)) for e in range(size.epochs))


DEMO_DRAFTERS = (("d_b8", 8, {}), ("d_b16", 16, {}))


def job_doc(
    run_dir: Path,
    size: DemoSize,
    report: dict,
    seed: int = 0,
    drafters_spec: tuple[tuple[str, int, dict], ...] = DEMO_DRAFTERS,
) -> dict:
    """The demo job: every drafter sees every batch; the lr schedule spans exactly the planned batches.
    drafters_spec: (name, block size, extra drafter keys) per drafter (bench/recipe_ab.py adds variants)."""
    assets = run_dir / "assets"
    batches = report["train_batches"]
    drafters = [
        {
            "name": name,
            "block_size": block,
            "num_layers": size.drafter_layers,
            "anchors_per_seq": size.anchors_per_seq,
            "dtype": "float32",
            "lr": size.drafter_lr,
            "warmup_frac": 0.04,
            "min_lr_ratio": 0.1,
            "total_steps": batches,
            "checkpoint_every": max(1, batches // 4),
            "log_every": 10,
            **extra,
        }
        for name, block, extra in drafters_spec
    ]
    return {
        "job": {"name": "demo", "run_dir": str(run_dir), "seed": seed},
        "target": {
            "path": str(assets / "target"),
            "dtype": "float32",
            "device": "cpu",
            "attn_implementation": "sdpa",
            "num_features": len(size.layer_ids),
            "layer_ids": list(size.layer_ids),
        },
        "data": {
            "path": str(assets / "train.jsonl"),
            "format": "chat",
            "max_length": size.max_length,
            "tokens_per_batch": size.tokens_per_batch,
            "epochs": size.epochs,
            "length_group_window": LENGTH_GROUP_WINDOW,
            "validation": VALIDATION,
            "eval_every": EVAL_EVERY,
            "validation_max_records": VALIDATION_MAX_RECORDS,
        },
        "transport": {"kind": "cpu", "slots": 4},
        "drafters": drafters,
        "telemetry": {"interval_s": 2.0, "wandb_mode": "offline", "wandb_project": "dflash-demo"},
    }


def prepare_demo(run_dir: str | Path, *, quick: bool, seed: int = 0, threads: int = BUILD_THREADS) -> Path:
    """Build the demo's assets under run_dir/assets unless a complete build of the same size is there;
    write run_dir/demo.toml and return its path. Holds the job lock throughout (common/joblock.py): a
    second prepare, or a launch of the demo job, is refused (JobLocked, naming the holder) instead of
    deleting the assets under a build or a training that runs."""
    run_dir = Path(run_dir).resolve()
    lock = joblock.exclusive(run_dir, "python -m demo prepare")
    try:
        return _prepare(run_dir, quick, seed, threads)
    finally:
        lock.release()


def _prepare(run_dir: Path, quick: bool, seed: int, threads: int) -> Path:
    size = QUICK if quick else FULL
    assets = run_dir / "assets"
    ready = assets / READY
    report = json.loads(ready.read_text()) if ready.is_file() else None
    wanted = {
        "version": ASSETS_VERSION,
        "size": json.loads(json.dumps(asdict(size))),
        "seed": seed,
        "torch_threads": threads,
    }
    if report is None or any(report.get(k) != v for k, v in wanted.items()):
        log(f"building the demo assets in {assets} ({'quick' if quick else 'full'})")
        report = build_assets(assets, size, seed, threads)
        log(f"assets built in {report['build_seconds']:.0f}s")
    else:
        log(f"demo assets are ready in {assets} (built in {report['build_seconds']:.0f}s; delete {ready} to rebuild)")
        if report.get("validation") != VALIDATION:  # built before the split: the plan's length without it
            tokenizer = load_tokenizer(assets / "tokenizer")
            report = {
                **report,
                "validation": VALIDATION,
                "train_batches": planned_batches(assets / "train.jsonl", tokenizer, size, seed),
            }
            tmp = ready.with_suffix(".tmp")
            tmp.write_text(json.dumps(report, indent=2) + "\n")
            tmp.replace(ready)
    job_path = run_dir / "demo.toml"
    text = job_text(
        job_doc(run_dir, size, report, seed),
        source=str(job_path),
        header="The embedded demo job, written by `python -m demo prepare` (CPU, float32).",
    )
    if not job_path.is_file() or job_path.read_text() != text:
        job_path.write_text(text)
    load_job(job_path)  # a demo that cannot start fails here, naming the key
    return job_path


def print_held_out(job) -> None:
    """Each drafter's held-out τ during training (data.validation: the job log's passes) and its best checkpoint."""
    records, _ = read_records([job.run_paths.root])
    for d in job.drafters:
        curve = held_out_curve(records, d.name)
        if curve:
            best = read_pointer(job.run_paths.checkpoints(d.name), BEST)
            points = ", ".join(f"{tau:.2f}@{step}" for _, step, tau in curve)
            print(
                f"{d.name}: held-out tau during training (tau@step): {points}; best: checkpoints/{d.name}/best ->"
                f" {best}",
                flush=True,
            )


def evaluate_demo(job_path: str | Path, limit: int | None = None, max_new_tokens: int = 160) -> tuple[dict, bool]:
    """Evaluate every drafter of the demo job on the held-out prompts; (reports by name, all lossless)."""
    from evaluation.evaluate import format_report, run_eval  # imported late: prepare needs no drafter code

    job = load_job(job_path)
    heldout = Path(job.job.run_dir) / "assets" / "heldout.jsonl"
    reports, ok = {}, True
    for d in job.drafters:
        ckpt = job.run_paths.checkpoints(d.name)
        report = run_eval(job.target.path, ckpt, heldout, limit=limit, max_new_tokens=max_new_tokens)
        print(format_report(report, d.name), flush=True)
        reports[d.name] = report.to_dict()
        ok &= report.lossless
    print_held_out(job)
    b16 = [r["tau"] for r in reports.values() if r["block_size"] == 16]
    if b16:
        verdict = "met" if b16[0] >= DEMO_GOAL_TAU else "NOT met"
        print(f"demo goal tau >= {DEMO_GOAL_TAU} for block 16: {verdict} (tau {b16[0]:.2f})", flush=True)
    (Path(job.job.run_dir) / "eval.json").write_text(json.dumps(reports, indent=2) + "\n")
    return reports, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the demo assets (cached) and print the job file's path")
    p.add_argument("run_dir")
    p.add_argument("--quick", action="store_true", help="tiny assets in seconds (tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=BUILD_THREADS,
        help=f"torch threads of the build (default {BUILD_THREADS}; another count builds other weights)",
    )
    e = sub.add_parser("evaluate", help="speculative decoding with the demo job's trained drafters")
    e.add_argument("job")
    e.add_argument("--limit", type=int, default=None, help="decode the first N held-out prompts (default: all)")
    e.add_argument("--json", action="store_true", help="print every report as one JSON object, last")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        watch_supervisor()  # launch.sh killed while the assets build: the build stops too, releasing the lock
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the job path alone (launch.sh reads it)
            try:
                job = prepare_demo(args.run_dir, quick=args.quick, seed=args.seed, threads=args.threads)
            except joblock.JobLocked as err:
                print(f"demo: {err}", file=sys.stderr)
                return 75  # as launch.sh refuses a second launch
        print(job)
        return 0
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        reports, ok = evaluate_demo(args.job, limit=args.limit)
    if args.json:
        print(json.dumps(reports))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
