"""`make gpu-check`: the prepared acceptance run on one GPU, meant to finish in under 8 minutes, nothing
downloaded. Without a CUDA device it prints what it would run and exits 0.

    .venv/bin/python -m bench.gpu_check [--pipeline-s 120] [--workdir DIR] [--md docs/gpu.md] [--dry-run]

Steps, in order; each is bounded, and each is reported even when an earlier one failed:
  tests      `pytest -m cuda`: every CUDA-marked test, with Triton compiled (tests/conftest.py interprets
             Triton only without CUDA), the CUDA ring between real processes (tests/test_ring.py) included.
  assets     a Qwen3-8B-shaped target with random weights built from a config (36 layers, hidden 4096,
             32 heads x 128, 8 KV heads, intermediate 12,288, vocab 151,936, bf16; captured layers
             [1, 9, 17, 25, 33]), initialised on the GPU and saved as a local model directory; a byte-level
             BPE tokenizer; synthetic chats; two job files: the stages' (one epoch) and the pipeline's.
             Two drafters of the published Qwen3-8B drafter shape (5 layers, block 16), both on cuda:0.
  stages     in this process (bench.pipeline_stages.JobStages, as bench.pipeline runs on the CPU): producer
             alone (target forward of packed 16k-token batches into a slot-sized buffer) and consumer alone
             (one drafter's train_batch on features captured beforehand), tokens/s over the plan's batches
             (varying lengths), each after a warm-up pass; GPU memory peak; torch.compile frames compiled
             during the timed passes (torch._dynamo counters: 0 means no recompiles); telemetry overhead:
             consumer steps in alternating blocks with the project's NVML sampler thread running or not.
  pipeline   the real processes, as launch.sh starts them (telemetry with NVML on, the producer, one
             consumer per drafter) for --pipeline-s seconds: tokens/s per drafter and the pipeline's, the
             medians over telemetry's windows after the first third; GPU memory peak from NVML, sampled by
             this script. Then SIGTERM: each consumer checkpoints at a step boundary.
  export     each drafter's exported checkpoint reloaded with AutoModel.from_pretrained(trust_remote_code)
             and its weights compared with the checkpoint's safetensors.
Output: the figures as a markdown table between the markers in --md, and one JSON line at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MD_BEGIN, MD_END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
TARGET = dict(hidden_size=4096, num_layers=36, heads=32, kv_heads=8, head_dim=128, intermediate_size=12288,
              vocab_size=151_936)
LAYER_IDS = [1, 9, 17, 25, 33]
DRAFTER = dict(num_layers=5, block_size=16)
TOKENS_PER_BATCH = 16384
MAX_LENGTH = 2048
STAGE_CHATS = 2000  # ~14 packed batches of varying lengths for the in-process stages
PIPELINE_EPOCHS = 100  # more than two minutes of data: the pipeline is stopped by SIGTERM, not by its end
BUDGET_S = {"tests": 240, "pipeline_start": 240, "stop": 300}  # stop: SIGTERM to exit, checkpoints written
PLAN = [
    ("tests", "pytest -m cuda (Triton compiled; the CUDA ring between real processes)"),
    ("assets", "Qwen3-8B-shaped random target (36 layers, hidden 4096, bf16, layers [1, 9, 17, 25, 33]) "
               "built on the GPU and saved; tokenizer; chats; job files"),
    ("stages", "producer alone and consumer alone (5-layer block-16 drafter) tokens/s, GPU memory peak, "
               "compiles during the timed passes, NVML sampler on/off step-time ratio"),
    ("pipeline", "telemetry (NVML) + producer + 2 consumers on one GPU for --pipeline-s s: tokens/s, memory"),
    ("export", "each drafter's checkpoint reloaded with AutoModel(trust_remote_code), weights compared"),
]


def log(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ steps


def junit_counts(path: Path) -> dict:
    """passed/failed/errors/skipped from a pytest --junitxml file, and the failing tests' names."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failing": []}
    for suite in suites:
        for case in suite.iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            kinds = {child.tag for child in case}
            if "failure" in kinds:
                out["failed"] += 1
                out["failing"].append(name)
            elif "error" in kinds:
                out["errors"] += 1
                out["failing"].append(name)
            elif "skipped" in kinds:
                out["skipped"] += 1
            else:
                out["passed"] += 1
    return out


def step_tests(workdir: Path) -> dict:
    xml = workdir / "cuda-tests.xml"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=BUDGET_S["tests"], capture_output=True, text=True)
    counts = junit_counts(xml) if xml.exists() else {}
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    ok = proc.returncode == 0 and counts.get("passed", 0) > 0
    return {"ok": ok, **counts, "exit": proc.returncode, "wall_s": round(time.perf_counter() - start, 1),
            "summary": tail}


def write_job(path: Path, run_dir: Path, assets: Path, data: str, epochs: int) -> Path:
    drafters = "".join(f"""
[[drafters]]
name = "b16_{i}"
block_size = {DRAFTER["block_size"]}
num_layers = {DRAFTER["num_layers"]}
devices = ["cuda:0"]
checkpoint_every = 1000000
total_steps = 100000
""" for i in range(2))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""
[job]
name = "gpucheck-{run_dir.name}"
run_dir = "{run_dir}"
[target]
path = "{assets / "target"}"
dtype = "bfloat16"
device = "cuda:0"
layer_ids = {LAYER_IDS}
num_features = {len(LAYER_IDS)}
[data]
path = "{assets / data}"
max_length = {MAX_LENGTH}
tokens_per_batch = {TOKENS_PER_BATCH}
epochs = {epochs}
[transport]
kind = "cuda"
[telemetry]
interval_s = 5.0
nvml_interval_s = 1.0
wandb_mode = "disabled"
{drafters}""")
    return path


def step_assets(workdir: Path) -> dict:
    import torch

    from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl

    assets = workdir / "assets"
    start = time.perf_counter()
    tok = train_tokenizer(corpus_texts(synthetic_chats(600, seed=0)), 2000, assets / "tokenizer")
    build_tiny_target(assets / "target", tok, seed=0, dtype=torch.bfloat16, device="cuda:0", **TARGET)
    torch.cuda.empty_cache()
    write_jsonl(assets / "stage_chats.jsonl", synthetic_chats(STAGE_CHATS, seed=1))
    write_jsonl(assets / "pipeline_chats.jsonl", synthetic_chats(STAGE_CHATS, seed=2))
    stage_job = write_job(workdir / "stages" / "job.toml", workdir / "stages", assets, "stage_chats.jsonl", 1)
    pipe_job = write_job(workdir / "pipe" / "job.toml", workdir / "pipe", assets, "pipeline_chats.jsonl",
                         PIPELINE_EPOCHS)
    size = sum(f.stat().st_size for f in (assets / "target").glob("*.safetensors"))
    return {"ok": True, "target_gib": round(size / 2**30, 2), "wall_s": round(time.perf_counter() - start, 1),
            "stage_job": str(stage_job), "pipeline_job": str(pipe_job)}


def dynamo_frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def step_stages(job_path: Path) -> dict:
    import logging

    import torch

    from bench.pipeline_stages import JobStages, time_variant
    from common.config import load_job
    from telemetry.nvml import NvmlSampler

    job = load_job(job_path)
    start = time.perf_counter()
    torch.cuda.reset_peak_memory_stats()
    stages = JobStages.load(job)
    n = len(stages.batches)
    tokens = sum(b.num_tokens for b in stages.batches)
    cores = set(os.sched_getaffinity(0))
    run_alone = stages.variants()["consumer_alone"][0]
    time_variant(stages.forward, range(n), cores)  # warm-up passes: kernels, autotuning, compiles
    time_variant(run_alone, range(n), cores)
    frames_before = dynamo_frames()
    producer = time_variant(stages.forward, range(n), cores)
    consumer = time_variant(run_alone, range(n), cores)
    compiled_in_timed = dynamo_frames() - frames_before
    # NVML sampler on/off: alternating blocks of the same batches, the block times' medians compared
    sampler_times: dict[bool, list[float]] = {True: [], False: []}
    sampler = None
    for block in range(4):
        on = block % 2 == 1
        if on:
            sampler = NvmlSampler(job.telemetry.nvml_interval_s, logging.getLogger("gpu_check.nvml"))
            sampler.start()
        sampler_times[on].append(time_variant(run_alone, range(n), cores)["wall_s"])
        if on and sampler is not None:
            sampler.stop()
    overhead = statistics.median(sampler_times[True]) / statistics.median(sampler_times[False])
    return {
        "ok": True,
        "batches": n,
        "tokens": tokens,
        "batch_tokens_min_max": [min(b.num_tokens for b in stages.batches),
                                 max(b.num_tokens for b in stages.batches)],
        "producer_alone_tokens_per_s": round(tokens / producer["wall_s"], 1),
        "consumer_alone_tokens_per_s": round(tokens / consumer["wall_s"], 1),
        "compiled_frames_total": dynamo_frames(),
        "compiled_frames_in_timed_passes": compiled_in_timed,
        "nvml_on_over_off_step_time": round(overhead, 4),
        "nvml_available": sampler is not None and sampler.available,
        "gpu_mem_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "wall_s": round(time.perf_counter() - start, 1),
    }


class NvmlPeak:
    """GPU memory used on every device, sampled every `interval_s` in a thread; the peak, in GiB."""

    def __init__(self, interval_s: float = 0.5) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.peak = 0
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nvml-peak", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            used = max(self.nv.nvmlDeviceGetMemoryInfo(h).used for h in self.handles)
            self.peak = max(self.peak, used)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        self.nv.nvmlShutdown()
        return round(self.peak / 2**30, 2)


def window_figures(metrics_jsonl: Path) -> dict:
    """Median tokens/s per drafter and of the pipeline over telemetry's windows after the first third."""
    rows = [json.loads(li)["metrics"] for li in metrics_jsonl.read_text().splitlines() if li.strip()]
    rows = [r for r in rows if any(k.endswith("/tokens_per_s") and v for k, v in r.items())]
    steady = rows[len(rows) // 3:]
    keys = sorted({k for r in steady for k in r if k.endswith("/tokens_per_s")})
    return {"windows": len(steady),
            **{k: round(statistics.median(r.get(k, 0.0) for r in steady), 1) for k in keys}}


def step_pipeline(job_path: Path, seconds: float) -> dict:
    from common.config import load_job

    job = load_job(job_path)
    logs = job.run_paths.root / "gpu-check-logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    roles = [("telemetry", ["-m", "telemetry", "--job", str(job_path)]),
             ("producer", ["-m", "producer", "--job", str(job_path)])]
    roles += [(d.name, ["-m", "consumer", "--job", str(job_path), "--drafter", d.name]) for d in job.drafters]
    peak = NvmlPeak()
    procs: dict[str, subprocess.Popen] = {}
    start = time.perf_counter()
    try:
        for name, args in roles:
            with open(logs / f"{name}.log", "wb") as out:
                procs[name] = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True)
        metrics = job.run_paths.metrics_jsonl
        deadline = time.monotonic() + BUDGET_S["pipeline_start"]
        while not (metrics.exists() and window_figures(metrics)["windows"] > 0):  # the first trained window
            dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"pipeline did not start training (exited: {dead}); logs in {logs}")
            time.sleep(2)
        started_s = time.perf_counter() - start
        time.sleep(seconds)
        figures = window_figures(metrics)
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"processes exited during the run: {dead}; logs in {logs}")
    finally:
        for name in [n for n in procs if n != "telemetry"] + ["telemetry"]:  # consumers checkpoint on SIGTERM
            p = procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {}
        for name, p in procs.items():
            try:
                codes[name] = p.wait(BUDGET_S["stop"])
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = p.wait(30)
        mem = peak.stop()
    drafter_rates = [v for k, v in figures.items() if k.startswith("drafter/")]
    return {"ok": all(c == 0 for c in codes.values()), "exit_codes": codes, "start_to_first_window_s":
            round(started_s, 1), "seconds": seconds, **figures,
            "pipeline_tokens_per_s": min(drafter_rates) if drafter_rates else None,
            "gpu_mem_peak_gib": mem, "logs": str(logs)}


def step_export(job_path: Path) -> dict:
    import torch
    import transformers
    from safetensors.torch import load_file

    from common.config import load_job
    from consumer.checkpoint import load_latest

    job = load_job(job_path)
    out = {"ok": True}
    for d in job.drafters:
        ckpt = load_latest(job.run_paths.checkpoints(d.name))
        if ckpt is None:
            out.update(ok=False, **{d.name: "no checkpoint written"})
            continue
        path = Path(ckpt.path)
        model = transformers.AutoModel.from_pretrained(str(path), trust_remote_code=True, local_files_only=True)
        saved = load_file(str(path / "model.safetensors"))
        state = model.state_dict()
        same = all(k in state and torch.equal(state[k].cpu().to(v.dtype), v) for k, v in saved.items())
        out[d.name] = {"step": ckpt.step, "tensors": len(saved), "weights_equal": same}
        out["ok"] &= same
    return out


# ------------------------------------------------------------------------------------------------ report


def render_table(results: dict) -> str:
    """The markdown table for docs/gpu.md: one row per figure, `failed: reason` where a step failed."""
    def get(step: str, key: str, unit: str = "") -> str:
        r = results.get(step) or {}
        if not r.get("ok", False) and "error" in r:
            return f"failed: {r['error'][:80]}"
        v = r.get(key)
        return "n/a" if v is None else f"{v}{unit}"

    t = results.get("tests") or {}
    rows = [
        ("CUDA-marked tests (Triton compiled)", f"{t.get('passed', 'n/a')} passed, {t.get('failed', 'n/a')} "
         f"failed, {t.get('errors', 'n/a')} errors, {t.get('skipped', 'n/a')} skipped" if t.get("ok") is not None
         and "error" not in t else get("tests", "passed")),
        ("producer alone, tokens/s", get("stages", "producer_alone_tokens_per_s")),
        ("consumer alone (one drafter), tokens/s", get("stages", "consumer_alone_tokens_per_s")),
        ("pipeline, 2 drafters, tokens/s (slowest drafter)", get("pipeline", "pipeline_tokens_per_s")),
        ("GPU memory peak, stages (torch allocator)", get("stages", "gpu_mem_peak_gib", " GiB")),
        ("GPU memory peak, pipeline (NVML, all processes)", get("pipeline", "gpu_mem_peak_gib", " GiB")),
        ("step time with NVML sampler on / off", get("stages", "nvml_on_over_off_step_time")),
        ("torch.compile frames compiled in the timed passes", get("stages", "compiled_frames_in_timed_passes")),
        ("export reloaded, weights equal", get("export", "ok")),
    ]
    head = f"Run {results['started']} on {results['device']}, pipeline {results['pipeline_s']:g} s.\n\n"
    return head + "| figure | value |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


def write_markdown(path: Path, table: str) -> None:
    text = path.read_text()
    if MD_BEGIN not in text or MD_END not in text:
        raise SystemExit(f"gpu_check: {path} lacks the {MD_BEGIN} / {MD_END} markers the table goes between")
    before, rest = text.split(MD_BEGIN, 1)
    after = rest.split(MD_END, 1)[1]
    path.write_text(f"{before}{MD_BEGIN}\n{table}{MD_END}{after}")


def run_step(results: dict, name: str, fn, *args) -> None:
    log(f"{name}: {dict(PLAN)[name]}")
    start = time.perf_counter()
    try:
        results[name] = fn(*args)
    except Exception as err:  # every step is reported: one failure must not hide the others' figures
        results[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    results[name].setdefault("wall_s", round(time.perf_counter() - start, 1))
    log(f"{name}: {json.dumps(results[name])[:400]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline-s", type=float, default=120.0, help="seconds the pipeline trains")
    ap.add_argument("--workdir", type=Path, default=None, help="assets and runs (default: a temporary folder)")
    ap.add_argument("--md", type=Path, default=ROOT / "docs" / "gpu.md", help="markdown file for the table")
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out (e.g. tests)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = ap.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if skip - dict(PLAN).keys():
        ap.error(f"--skip: unknown step(s) {sorted(skip - dict(PLAN).keys())}; steps: {','.join(dict(PLAN))}")

    import torch

    if args.dry_run or not torch.cuda.is_available():
        why = "--dry-run" if args.dry_run else "no CUDA device is visible"
        print(f"gpu_check: {why}; on a GPU this would run, in under 8 minutes:")
        for name, what in PLAN:
            print(f"  {name:9s} {what}" + ("  [skipped by --skip]" if name in skip else ""))
        print(f"  then write the table into {args.md} and print one JSON line")
        return 0

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dfg-", dir="/tmp"))  # short: ipc path limit
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "pipeline_s": args.pipeline_s}
    started = time.perf_counter()
    try:
        if "tests" not in skip:
            run_step(results, "tests", step_tests, workdir)
        run_step(results, "assets", step_assets, workdir)
        if results["assets"].get("ok"):
            stage_job, pipe_job = Path(results["assets"]["stage_job"]), Path(results["assets"]["pipeline_job"])
            if "stages" not in skip:
                run_step(results, "stages", step_stages, stage_job)
                gc.collect()
                torch.cuda.empty_cache()  # the pipeline's processes need the memory this one holds
            if "pipeline" not in skip:
                run_step(results, "pipeline", step_pipeline, pipe_job, args.pipeline_s)
                if "export" not in skip:
                    run_step(results, "export", step_export, pipe_job)
    finally:
        results["wall_s"] = round(time.perf_counter() - started, 1)
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    results["ok"] = all(results[s].get("ok") for s, _ in PLAN if s in results)
    write_markdown(args.md, render_table(results))
    print(json.dumps(results))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
