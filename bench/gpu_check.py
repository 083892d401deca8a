"""`make gpu-check`: the prepared acceptance run on one GPU, planned to fit the lend (15 minutes of GPU time in
all, 10 minutes a command): seven stages, each its own command of at most 4 minutes with its own JSON line,
480 s in all by the plan below, nothing downloaded, no file over 5 GB written. Without a CUDA device it prints
the plan with each stage's budget and planned memory, and exits 0.

    .venv/bin/python -m bench.gpu_check [--workdir DIR] [--md docs/gpu.md] [--skip STAGES] [--dry-run]

Stages (bench/gpu_check_stages.py; each under its budget, each reported even when another failed):
  tests     `pytest -m cuda`: every CUDA-marked test with Triton compiled, the CUDA ring between real processes.
  memory    one process's CUDA context as NVML sees it, against the memory planner's allowance.
  assets    tokenizer, chats, a 6-layer target of Qwen3-8B's layer shapes (the pipeline's checkpoint, ~4.5 GiB),
            job files.
  producer  the full 36-layer Qwen3-8B-shaped target (hidden 4096, 32 heads x 128, 8 KV heads, intermediate
            12,288, vocab 151,936, bf16, captured layers [1, 9, 17, 25, 33]) built on the GPU with random
            weights (no file): packed 16k-token forwards into a slot-sized buffer; warm-up on the plan's first
            batches, tokens/s over the later ones (never seen by the warm-up).
  consumer  one drafter of the published Qwen3-8B drafter shape (5 layers, block 16): train_batch on the same
            plan, random features; tokens/s on unseen batches; the NVML sampler on / off step-time ratio.
            Both: Dynamo's own counters (frames, graphs, recompiles) in the warm-up and in the timed batches.
  pipeline  the real processes (telemetry with NVML, producer, two consumers) on the 6-layer checkpoint:
            tokens/s per drafter over telemetry's windows, NVML memory peak; then SIGKILL: no checkpoint.
  export    a one-layer drafter trained two steps, exported (weights + config only), reloaded with
            AutoModel.from_pretrained(trust_remote_code) and its weights compared.
Output: each stage's JSON line as it ends, the table between the markers in --md, one summary JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness

ROOT = Path(__file__).resolve().parent.parent
MD_BEGIN, MD_END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
TARGET = dict(
    hidden_size=4096, num_layers=36, heads=32, kv_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151_936
)
LAYER_IDS = [1, 9, 17, 25, 33]
PIPELINE_TARGET_LAYERS = 6  # the pipeline's target checkpoint: Qwen3-8B's layers, fewer of them (~4.5 GiB on disk)
PIPELINE_LAYER_IDS = [1, 2, 3, 4, 5]
DRAFTER = dict(num_layers=5, block_size=16)
TOKENS_PER_BATCH = 16384
# two drafters and the target share the GPU: 95.7 GiB planned with Muon (103.5 with AdamW's state)
PIPELINE_TOKENS_PER_BATCH = 12288
MAX_LENGTH = 2048
STAGE_CHATS = 2000  # ~14 packed batches of varying lengths
WARMUP_BATCHES = 4  # compiled and autotuned here; the batches after them are timed
PIPELINE_START_S, PIPELINE_S = 60, 40
PIPELINE_EPOCHS = 100  # more data than the run lasts: it ends by SIGKILL, not by its end
H200_GIB = 139.7  # what NVML reports for one H200

# The time and memory plan: stage → (budget in seconds: the command's timeout, peak GPU memory in GiB planned
# by common/memory_plan.py's tools at these shapes (docs/gpu.md), what it runs). The budgets are estimates for
# one H200 with the reasons given; the first run replaces them with the measured wall_s of each stage.
PLAN: dict[str, tuple[int, float | None, str]] = {
    # ~25 CUDA tests, a few s each with Triton compiles; the rest is pytest's start. Memory: test shapes, unplanned
    "tests": (120, None, "pytest -m cuda (Triton compiled; the CUDA ring between real processes)"),
    "memory": (20, 0.5, "one CUDA context measured by NVML against the planner's 512 MiB allowance"),
    # a 4.5 GiB target written at >= 0.5 GB/s, tokenizer and chats in seconds
    "assets": (40, 5.0, "tokenizer, chats, 6-layer 8B-shaped target checkpoint (~4.5 GiB), job files"),
    # imports 10 s, 16 GB of random weights on the GPU 5 s, 4 warm-up forwards with flex compiles ~25 s, 10 timed
    "producer": (60, 16.0, "36-layer Qwen3-8B-shaped target built in GPU memory: tokens/s on unseen 16k batches"),
    # imports 10 s, flex compiles per (bucket, layer kind) in the warm-up ~40 s, 3 passes over 10 batches
    "consumer": (100, 55.1, "5-layer block-16 drafter train_batch: tokens/s on unseen batches, NVML on/off"),
    # start-up (imports, load, compiles) <= 60 s, 40 s measured, kill
    "pipeline": (110, 95.7, "telemetry (NVML) + producer + 2 consumers on one GPU for 40 s: tokens/s, memory"),
    "export": (30, 8.5, "one-layer drafter exported and reloaded with AutoModel(trust_remote_code)"),
}
NEEDS_ASSETS = ("producer", "consumer", "pipeline", "export")
STAGE_LIMIT_S, TOTAL_LIMIT_S = 240, 480


def planned_memory() -> dict[str, float]:
    """Each stage's peak GPU memory in GiB by the memory planner (producer/ and consumer/memory_plan.py) at the
    stages' shapes, on the CPU in about a minute: `python -m bench.gpu_check --replan` prints it for PLAN."""
    import copy

    from common.config import DrafterConfig
    from common.memory_plan import CUDA_CONTEXT_BYTES, GIB
    from common.packed_batch import required_slot_bytes
    from consumer.memory_plan import step_peak
    from consumer.model import DrafterArch
    from producer.memory_plan import forward_peak, prefix_of_every_kind, weight_bytes

    t = TARGET
    text = target_config()

    def target(layers: int, tokens: int, slots: int) -> int:
        cut = copy.deepcopy(text)
        cut.num_hidden_layers = layers
        width = len(LAYER_IDS) * t["hidden_size"]
        return (
            weight_bytes(cut, "bfloat16")
            + forward_peak(prefix_of_every_kind(cut), "bfloat16", tokens)
            + slots * required_slot_bytes(tokens, width, "bfloat16")
        )

    parts = target_parts(Path("."))

    def drafter(layers: int, tokens: int) -> int:
        cfg = DrafterConfig(name="d", block_size=DRAFTER["block_size"], num_layers=layers)
        arch = DrafterArch.from_target(parts, cfg, len(LAYER_IDS))
        return step_peak(arch, cfg, t["vocab_size"], False, tokens, MAX_LENGTH, "bfloat16", cuda=True)["peak"]

    small = copy.deepcopy(text)
    small.num_hidden_layers = PIPELINE_TARGET_LAYERS
    ctx = CUDA_CONTEXT_BYTES
    figures = {
        "memory": ctx,
        "assets": weight_bytes(small, "bfloat16") + t["vocab_size"] * t["hidden_size"] * 2 + ctx,  # + the LM head
        "producer": target(max(LAYER_IDS) + 1, TOKENS_PER_BATCH, 1) + ctx,
        "consumer": drafter(DRAFTER["num_layers"], TOKENS_PER_BATCH) + ctx,
        "pipeline": target(PIPELINE_TARGET_LAYERS, PIPELINE_TOKENS_PER_BATCH, 4)
        + 2 * drafter(DRAFTER["num_layers"], PIPELINE_TOKENS_PER_BATCH)
        + 3 * ctx,
        "export": drafter(1, 4096) + ctx,
    }
    return {k: round(v / GIB, 1) for k, v in figures.items()}


def budget(stage: str) -> int:
    return PLAN[stage][0]


def log(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)


def target_config():
    """The check's target (TARGET: Qwen3-8B's shape) as a transformers config, untied like Qwen3-8B."""
    from transformers import Qwen3Config

    t = TARGET
    return Qwen3Config(
        vocab_size=t["vocab_size"],
        hidden_size=t["hidden_size"],
        num_hidden_layers=t["num_layers"],
        num_attention_heads=t["heads"],
        num_key_value_heads=t["kv_heads"],
        head_dim=t["head_dim"],
        intermediate_size=t["intermediate_size"],
        tie_word_embeddings=False,
    )


def target_parts(path: Path, embed=None, lm_head=None):
    """The check's target (TARGET: Qwen3-8B's shape) as the drafter sees it; `embed`/`lm_head` None for planning."""
    from consumer.target_parts import TargetParts

    t = TARGET
    return TargetParts(
        path=path,
        hidden_size=t["hidden_size"],
        num_attention_heads=t["heads"],
        num_key_value_heads=t["kv_heads"],
        head_dim=t["head_dim"],
        intermediate_size=t["intermediate_size"],
        rms_norm_eps=1e-6,
        vocab_size=t["vocab_size"],
        num_hidden_layers=t["num_layers"],
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        embed_tokens=embed,
        lm_head=lm_head,
    )


def write_job(path: Path, run_dir: Path, assets: Path, data: str, epochs: int, tokens_per_batch: int) -> Path:
    """A job file of the check's shapes: the small target checkpoint, two drafters on cuda:0."""
    drafters = [
        {
            "name": f"b16_{i}",
            "block_size": DRAFTER["block_size"],
            "num_layers": DRAFTER["num_layers"],
            "devices": ["cuda:0"],
            "checkpoint_every": 1000000,
            "total_steps": 100000,
        }
        for i in range(2)
    ]
    doc = {
        "job": {"name": f"gpucheck-{run_dir.name}", "run_dir": str(run_dir)},
        "target": {
            "path": str(assets / "target"),
            "dtype": "bfloat16",
            "device": "cuda:0",
            "layer_ids": list(PIPELINE_LAYER_IDS),
            "num_features": len(PIPELINE_LAYER_IDS),
        },
        "data": {
            "path": str(assets / data),
            "max_length": MAX_LENGTH,
            "tokens_per_batch": tokens_per_batch,
            "epochs": epochs,
        },
        "transport": {"kind": "cuda"},
        "telemetry": {"interval_s": 5.0, "nvml_interval_s": 1.0, "wandb_mode": "disabled"},
        "drafters": drafters,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    return harness.write_job(path, doc)


def run_stage(name: str, workdir: Path) -> dict:
    """One stage as its own command under its budget; its JSON line, or why there is none."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "bench.gpu_check_stages", name, "--workdir", str(workdir)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=None, text=True, timeout=budget(name)
        )
    except subprocess.TimeoutExpired:
        return {
            "stage": name,
            "ok": False,
            "error": f"over its budget of {budget(name)} s",
            "wall_s": round(time.perf_counter() - start, 1),
        }
    lines = [li for li in proc.stdout.splitlines() if li.startswith("{")]
    if not lines:
        return {
            "stage": name,
            "ok": False,
            "error": f"exited {proc.returncode} without its JSON line",
            "wall_s": round(time.perf_counter() - start, 1),
        }
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------------------------ report


def render_table(results: dict) -> str:
    """The markdown table for docs/gpu.md: one row per figure, `failed: reason` where a stage failed."""

    def get(stage: str, key: str, unit: str = "") -> str:
        r = results.get(stage) or {}
        if not r.get("ok", False) and "error" in r:
            return f"failed: {r['error'][:80]}"
        v = r.get(key)
        return "n/a" if v is None else f"{v}{unit}"

    t = results.get("tests") or {}
    tests = (
        f"{t.get('passed', 'n/a')} passed, {t.get('failed', 'n/a')} failed, {t.get('errors', 'n/a')} errors,"
        f" {t.get('skipped', 'n/a')} skipped"
        if t.get("ok") is not None and "error" not in t
        else get("tests", "passed")
    )
    rows = [
        ("CUDA-marked tests (Triton compiled)", tests),
        ("CUDA context of one process (NVML), MiB", get("memory", "cuda_context_mib")),
        ("producer alone (36-layer 8B-shaped target), tokens/s", get("producer", "tokens_per_s")),
        ("consumer alone (one drafter), tokens/s", get("consumer", "tokens_per_s")),
        ("pipeline, 2 drafters, tokens/s (slowest drafter)", get("pipeline", "pipeline_tokens_per_s")),
        ("GPU memory peak, producer (torch allocator)", get("producer", "gpu_mem_peak_gib", " GiB")),
        ("GPU memory peak, consumer (torch allocator)", get("consumer", "gpu_mem_peak_gib", " GiB")),
        ("GPU memory peak, pipeline (NVML, all processes)", get("pipeline", "gpu_mem_peak_gib", " GiB")),
        ("step time with NVML sampler on / off", get("consumer", "nvml_on_over_off_step_time")),
        ("Dynamo recompiles in the timed (unseen) batches, producer", get("producer", "recompiles_in_timed_batches")),
        ("Dynamo recompiles in the timed (unseen) batches, consumer", get("consumer", "recompiles_in_timed_batches")),
        ("export reloaded, weights equal", get("export", "weights_equal")),
    ]
    walls = ", ".join(f"{s} {results[s]['wall_s']:g}" for s in PLAN if s in results and "wall_s" in results[s])
    head = f"Run {results['started']} on {results['device']}; stage wall s: {walls}.\n\n"
    return head + "| figure | value |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


def write_markdown(path: Path, table: str) -> None:
    text = path.read_text()
    if MD_BEGIN not in text or MD_END not in text:
        raise SystemExit(f"gpu_check: {path} lacks the {MD_BEGIN} / {MD_END} markers the table goes between")
    before, rest = text.split(MD_BEGIN, 1)
    after = rest.split(MD_END, 1)[1]
    path.write_text(f"{before}{MD_BEGIN}\n{table}{MD_END}{after}")


def plan_text(skip: set[str]) -> str:
    lines = [
        f"  {name:9s} {secs:4d} s  {'unplanned' if gib is None else f'{gib:5.1f} GiB':>9s}  {what}"
        + ("  [skipped by --skip]" if name in skip else "")
        for name, (secs, gib, what) in PLAN.items()
    ]
    total = sum(secs for name, (secs, _, _) in PLAN.items() if name not in skip)
    lines.append(
        f"  total     {total:4d} s (each stage its own command; at most {STAGE_LIMIT_S} s a stage,"
        f" {TOTAL_LIMIT_S} s in all); peak memory of the largest stage"
        f" {max(g for _, g, _ in PLAN.values() if g is not None):.1f} of {H200_GIB} GiB"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None, help="assets and runs (default: a temporary folder)")
    ap.add_argument("--md", type=Path, default=ROOT / "docs" / "gpu.md", help="markdown file for the table")
    ap.add_argument("--skip", default="", help="comma-separated stages to leave out (e.g. tests)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--replan", action="store_true", help="compute each stage's planned GPU memory (CPU, ~1 min)")
    args = ap.parse_args(argv)
    if args.replan:
        print(json.dumps(planned_memory()))
        return 0
    skip = {s for s in args.skip.split(",") if s}
    if skip - PLAN.keys():
        ap.error(f"--skip: unknown stage(s) {sorted(skip - PLAN.keys())}; stages: {','.join(PLAN)}")

    import torch

    if args.dry_run or not torch.cuda.is_available():
        why = "--dry-run" if args.dry_run else "no CUDA device is visible"
        print(f"gpu_check: {why}; on a GPU this would run, stage by stage (budget, planned peak GPU memory):")
        print(plan_text(skip))
        print(f"  then write the table into {args.md} and print one JSON line")
        return 0

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dfg-", dir="/tmp"))  # short: ipc path limit
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    started = time.perf_counter()
    try:
        for name in PLAN:
            if name in skip:
                continue
            assets = (results.get("assets") or {}).get("ok") or ("assets" in skip and (workdir / "assets").is_dir())
            if name in NEEDS_ASSETS and not assets:
                results[name] = {
                    "stage": name,
                    "ok": False,
                    "error": "no assets (the assets stage failed or was skipped)",
                }
            else:
                log(f"{name}: {PLAN[name][2]} (budget {budget(name)} s)")
                results[name] = run_stage(name, workdir)
            print(json.dumps(results[name]), flush=True)  # each stage's line as it ends
    finally:
        results["wall_s"] = round(time.perf_counter() - started, 1)
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    results["ok"] = all(results[s].get("ok") for s in PLAN if s in results)
    write_markdown(args.md, render_table(results))
    print(
        json.dumps(
            {
                "summary": True,
                **{k: v for k, v in results.items() if k not in PLAN},
                "stages_ok": {s: results[s].get("ok") for s in PLAN if s in results},
            }
        )
    )
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
