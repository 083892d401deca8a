"""`make gpu-check`: the prepared acceptance run on one GPU, planned to fit the lend (15 minutes of GPU time in
all, 10 minutes a command, the bundle's install included): nine stages, each its own command of at most 4
minutes with its own JSON line, nothing downloaded, no file over 5 GB written, the memory-heavy stages sized to
the device's memory. Without a CUDA device, or with --plan, it prints the plan and exits 0.

    python -m bench.gpu_check [--workdir DIR] [--md docs/gpu.md] [--skip STAGES] [--plan] [--device-memory GIB]

Stages (bench/gpu_check_stages.py; each under its budget, each reported even when another failed):
  ipc       CUDA IPC between two processes (the slot ring's path): where it fails, the stages that need it
            (the pipeline; the ring's CUDA tests) are skipped and the report says why.
  imports   every module the stages and the pipeline's processes import, with the versions found.
  tests     pytest on the CUDA test files only: every CUDA-marked test with Triton compiled.
  memory    one process's CUDA context as NVML sees it, against the memory planner's allowance.
  assets    tokenizer, chats, a 6-layer target of Qwen3-8B's layer shapes (the pipeline's checkpoint, ~4.5 GiB),
            job files at the shapes sized to the device.
  producer  the full 36-layer Qwen3-8B-shaped target (hidden 4096, 32 heads x 128, 8 KV heads, intermediate
            12,288, vocab 151,936, bf16, captured layers [1, 9, 17, 25, 33]) built on the GPU with random
            weights (no file): packed forwards into a slot-sized buffer; warm-up on the plan's first
            batches, tokens/s over the later ones (never seen by the warm-up).
  consumer  one drafter of the published Qwen3-8B drafter shape (5 layers, block 16): train_batch on the same
            plan, random features; tokens/s on unseen batches; the NVML sampler on / off step-time ratio.
            Both: Dynamo's own counters (frames, graphs: a graph in the timed batches is a recompile) and compile seconds apart from run seconds.
  pipeline  the real processes (telemetry with NVML, producer, two consumers) on the 6-layer checkpoint:
            tokens/s per drafter over telemetry's windows, NVML memory peak; then SIGKILL: no checkpoint.
  export    a one-layer drafter trained two steps, exported (weights + config only), reloaded with
            AutoModel.from_pretrained(trust_remote_code) and its weights compared.
Output: each stage's JSON line as it ends, the table between the markers in --md, one summary JSON line.
The plan (budgets, planned memory, shapes per device size) is bench/gpu_check_plan.py.
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
from collections.abc import Callable
from pathlib import Path

from bench import harness
from bench.gpu_check_plan import (
    DRAFTER,
    H200_GIB,
    MAX_LENGTH,
    PIPELINE_LAYER_IDS,
    PLAN,
    Sizing,
    device_gib,
    plan_text,
    planned_memory,
    size_for,
)

ROOT = Path(__file__).resolve().parent.parent
MD_BEGIN, MD_END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
STAGE_CHATS = 2000  # ~14 packed batches of 16k tokens, of varying lengths
WARMUP_BATCHES = 4  # compiled and autotuned here; the batches after them are timed
PIPELINE_START_S, PIPELINE_S = 60, 40
PIPELINE_EPOCHS = 100  # more data than the run lasts: it ends by SIGKILL, not by its end
NEEDS_ASSETS = ("producer", "consumer", "pipeline", "export")


def budget(stage: str) -> int:
    return PLAN[stage].budget_s


def log(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)


def with_root(env: dict) -> dict:
    """`env` with the repository first on PYTHONPATH, keeping what was there (the device bundle's site)."""
    path = [str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


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


def run_stage(name: str, workdir: Path, args: list[str] | None = None) -> dict:
    """One stage as its own command under its budget; its JSON line, or why there is none."""
    env = with_root(dict(os.environ))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "bench.gpu_check_stages", name, "--workdir", str(workdir), *(args or [])]
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


def ipc_skips(ipc: dict) -> dict[str, str]:
    """The stages that cannot run after the IPC probe's answer, with why; {} where CUDA IPC works."""
    if ipc.get("cuda_ipc"):
        return {}
    why = (
        f"no CUDA IPC between processes here ({ipc.get('error', 'the probe gave no answer')}): the slot ring cannot run"
    )
    return {s: why for s, p in PLAN.items() if p.needs_ipc}


def run_stages(
    workdir: Path, sizing: Sizing, skip: set[str], run: Callable[[str, Path, list[str]], dict] = run_stage
) -> dict:
    """Every stage in order, each under its budget: the IPC probe's answer and the device's size decide which
    run; a stage left out gets a `skipped` line saying why (and `ok` None: neither passed nor failed)."""
    results: dict = {}
    skipped = {s: "--skip" for s in skip} | sizing.does_not_fit()
    no_ipc = False
    for name in PLAN:
        if name in skipped:
            results[name] = {"stage": name, "ok": None, "skipped": skipped[name]}
            continue
        assets = (results.get("assets") or {}).get("ok") or ("assets" in skip and (workdir / "assets").is_dir())
        if name in NEEDS_ASSETS and not assets:
            results[name] = {"stage": name, "ok": False, "error": "no assets (the assets stage failed or was skipped)"}
        else:
            args = ["--device-memory", f"{sizing.device_gib:g}"]
            args += ["--no-ipc"] if name == "tests" and no_ipc else []
            log(f"{name}: {PLAN[name].what} (budget {budget(name)} s)")
            results[name] = run(name, workdir, args)
        if name == "ipc":
            log(results[name].get("says", "the probe gave no answer"))
            no_ipc = not results[name].get("cuda_ipc")
            skipped |= {s: why for s, why in ipc_skips(results[name]).items() if s not in skipped}
        print(json.dumps(results[name]), flush=True)  # each stage's line as it ends
    return results


# ------------------------------------------------------------------------------------------------ report


def render_table(results: dict) -> str:
    """The markdown table for docs/gpu.md: one row per figure, `failed: reason` where a stage failed."""

    def get(stage: str, key: str, unit: str = "") -> str:
        r = results.get(stage) or {}
        if "skipped" in r:
            return f"skipped: {r['skipped'][:100]}"
        if not r.get("ok", False) and "error" in r:
            return f"failed: {r['error'][:80]}"
        v = r.get(key)
        return "n/a" if v is None else f"{v}{unit}"

    def split(stage: str) -> str:
        r = results.get(stage) or {}
        return f"{r['compile_s']:g} / {r['run_s']:g}" if "compile_s" in r and "run_s" in r else get(stage, "compile_s")

    t = results.get("tests") or {}
    tests = (
        f"{t.get('passed', 'n/a')} passed, {t.get('failed', 'n/a')} failed, {t.get('errors', 'n/a')} errors,"
        f" {t.get('skipped', 'n/a')} skipped"
        if t.get("ok") is not None and "error" not in t
        else get("tests", "passed")
    )
    rows = [
        ("CUDA IPC between two processes (the ring)", get("ipc", "cuda_ipc")),
        ("CUDA-marked tests (Triton compiled)", tests),
        ("CUDA context of one process (NVML), MiB", get("memory", "cuda_context_mib")),
        ("producer alone (36-layer 8B-shaped target), tokens/s", get("producer", "tokens_per_s")),
        ("consumer alone (one drafter), tokens/s", get("consumer", "tokens_per_s")),
        ("pipeline, 2 drafters, tokens/s (slowest drafter)", get("pipeline", "pipeline_tokens_per_s")),
        ("GPU memory peak, producer (torch allocator)", get("producer", "gpu_mem_peak_gib", " GiB")),
        ("GPU memory peak, consumer (torch allocator)", get("consumer", "gpu_mem_peak_gib", " GiB")),
        ("GPU memory peak, pipeline (NVML, all processes)", get("pipeline", "gpu_mem_peak_gib", " GiB")),
        ("step time with NVML sampler on / off", get("consumer", "nvml_on_over_off_step_time")),
        ("Dynamo graphs compiled in the timed (unseen) batches, producer", get("producer", "graphs_in_timed_batches")),
        ("Dynamo graphs compiled in the timed (unseen) batches, consumer", get("consumer", "graphs_in_timed_batches")),
        ("compile s / run s, producer", split("producer")),
        ("compile s / run s, consumer", split("consumer")),
        ("compile s / run s, pipeline (start to first window / measured)", split("pipeline")),
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None, help="assets and runs (default: a temporary folder)")
    ap.add_argument("--md", type=Path, default=ROOT / "docs" / "gpu.md", help="markdown file for the table")
    ap.add_argument("--skip", default="", help="comma-separated stages to leave out (e.g. tests)")
    ap.add_argument("--plan", "--dry-run", dest="plan", action="store_true", help="print the plan and exit")
    ap.add_argument(
        "--device-memory", type=float, default=None, help="GiB to size the stages to (default: the device's)"
    )
    ap.add_argument("--replan", action="store_true", help="compute each stage's planned GPU memory (CPU, ~1 min)")
    args = ap.parse_args(argv)
    if args.replan:
        print(json.dumps(planned_memory()))
        return 0
    skip = {s for s in args.skip.split(",") if s}
    if skip - PLAN.keys():
        ap.error(f"--skip: unknown stage(s) {sorted(skip - PLAN.keys())}; stages: {','.join(PLAN)}")
    if args.device_memory is not None and args.device_memory <= 0:
        ap.error(f"--device-memory: expected GiB > 0, got {args.device_memory:g}")

    found = device_gib()
    sizing = size_for(args.device_memory or found or H200_GIB)
    if args.plan or found is None:
        why = "--plan" if args.plan else "no CUDA device is visible"
        source = "--device-memory" if args.device_memory else "the device" if found else "an H200's, no device seen"
        print(f"gpu_check: {why}; on a GPU this would run, stage by stage (GPU memory: {source}):")
        print(plan_text(sizing, skip))
        print(f"  then write the table into {args.md} and print one JSON line")
        return 0

    import torch

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dfg-", dir="/tmp"))  # short: ipc path limit
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "device_gib": sizing.device_gib,
        "shapes": {"stage_tokens": sizing.stage_tokens, "pipeline_tokens": sizing.pipeline_tokens},
    }
    started = time.perf_counter()
    try:
        results |= run_stages(workdir, sizing, skip)
    finally:
        results["wall_s"] = round(time.perf_counter() - started, 1)
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    ran = [s for s in PLAN if s in results and "skipped" not in results[s]]
    results["ok"] = all(results[s].get("ok") for s in ran)
    write_markdown(args.md, render_table(results))
    print(
        json.dumps(
            {
                "summary": True,
                **{k: v for k, v in results.items() if k not in PLAN},
                "stages_ok": {s: results[s].get("ok") for s in ran},
                "skipped": {s: results[s]["skipped"] for s in PLAN if "skipped" in results.get(s, {})},
            }
        )
    )
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
