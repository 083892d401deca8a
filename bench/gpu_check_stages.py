"""The stages of `make gpu-check` (bench/gpu_check.py), one per command:

    python -m bench.gpu_check_stages STAGE --workdir DIR

Each prints one JSON line on stdout ({"stage": ..., "ok": ..., figures}) and exits 0 when ok; the driver runs
it under the stage's time budget, so a stage that fails or hangs costs its own figures only. Stages after
`assets` read its folder (tokenizer, chats, the pipeline's small target checkpoint, job files).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

from bench import gpu_check as check
from bench import gpu_check_plan as plan

ROOT = Path(__file__).resolve().parent.parent
# what the stages and the pipeline's processes import (the imports stage tries each: a missing package shows in
# seconds, not after the tests stage); VERSIONS: the distributions it reports
IMPORTS = (
    "producer.__main__",
    "consumer.__main__",
    "telemetry.__main__",
    "producer.build",
    "producer.prefetch",
    "producer.target",
    "consumer.trainer",
    "consumer.target_parts",
    "consumer.export.layout",
    "common.ring_cuda",
    "telemetry.nvml",
    "demo.tiny",
    "pynvml",
    "safetensors.torch",
    "pytest",
)
VERSIONS = ("torch", "triton", "transformers", "tokenizers", "huggingface-hub", "pydantic", "pyzmq", "numpy", "pytest")
# the CUDA test files whose tests share CUDA memory between processes (the slot ring's children)
IPC_TEST_FILES = ("tests/common/test_ring.py",)


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


def window_figures(metrics_jsonl: Path) -> dict:
    """Median tokens/s per drafter and of the pipeline over telemetry's windows after the first third."""
    rows = [json.loads(li)["metrics"] for li in metrics_jsonl.read_text().splitlines() if li.strip()]
    rows = [r for r in rows if any(k.endswith("/tokens_per_s") and v for k, v in r.items())]
    steady = rows[len(rows) // 3 :]
    keys = sorted({k for r in steady for k in r if k.endswith("/tokens_per_s")})
    return {"windows": len(steady), **{k: round(statistics.median(r.get(k, 0.0) for r in steady), 1) for k in keys}}


# ------------------------------------------------------------------------------------------------ stages


def cuda_test_files() -> list[str]:
    """The test files that hold CUDA-marked tests: only these are collected, so a module elsewhere that imports
    what the GPU image lacks cannot stop the stage."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.cuda" in p.read_text())


def stage_ipc(workdir: Path, opts) -> dict:
    """CUDA IPC between two processes (bench/ipc_probe.py): where it fails, the driver skips the ring's stages."""
    from bench.ipc_probe import probe

    answer = probe(timeout_s=check.budget("ipc") - 5)
    return {"ok": answer["cuda"], **answer}  # ok: the probe ran; its answer is cuda_ipc


def stage_imports(workdir: Path, opts) -> dict:
    """Every module the stages and the pipeline's processes import, and the versions this Python found."""
    import importlib
    from importlib import metadata

    failed = {}
    for module in IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as err:  # each import's failure is a finding, the others are still tried
            failed[module] = f"{type(err).__name__}: {str(err)[:200]}"
    versions = {}
    for dist in VERSIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {"ok": not failed, "modules": len(IMPORTS), "failed": failed, "versions": versions}


def stage_tests(workdir: Path, opts) -> dict:
    xml = workdir / "cuda-tests.xml"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    files = cuda_test_files()
    left_out = [f for f in files if opts.no_ipc and f in IPC_TEST_FILES]
    files = [f for f in files if f not in left_out]
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=check.budget("tests") - 15
    )  # the rest: this process's own start and report
    counts = junit_counts(xml) if xml.exists() else {}
    return {
        "ok": proc.returncode == 0 and counts.get("passed", 0) > 0,
        **counts,
        "exit": proc.returncode,
        "files": len(files),
        **(
            {"left_out": {f: "needs CUDA IPC between processes, which failed here" for f in left_out}}
            if left_out
            else {}
        ),
        "summary": (proc.stdout + proc.stderr).strip().splitlines()[-3:],
    }


def stage_memory(workdir: Path, opts) -> dict:
    """One process's CUDA context on the GPU, as NVML sees it, against the planner's allowance."""
    import pynvml
    import torch

    from common.memory_plan import CUDA_CONTEXT_BYTES

    torch.ones(1, device="cuda").sum().item()  # context, allocator and one kernel loaded
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()]
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    finally:
        pynvml.nvmlShutdown()
    context = (mine[0] if mine and mine[0] else 0) - torch.cuda.memory_reserved()
    return {
        "ok": bool(mine),
        "cuda_context_mib": round(context / 2**20, 1),
        "planned_cuda_context_mib": CUDA_CONTEXT_BYTES / 2**20,
        "device_gib": round(total / 2**30, 1),
    }


def stage_assets(workdir: Path, opts) -> dict:
    import torch

    from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl

    assets = workdir / "assets"
    tok = train_tokenizer(corpus_texts(synthetic_chats(600, seed=0)), 2000, assets / "tokenizer")
    build_tiny_target(
        assets / "target",
        tok,
        seed=0,
        dtype=torch.bfloat16,
        device="cuda:0",
        **{**plan.TARGET, "num_layers": plan.PIPELINE_TARGET_LAYERS},
    )
    write_jsonl(assets / "stage_chats.jsonl", synthetic_chats(check.STAGE_CHATS, seed=1))
    write_jsonl(assets / "pipeline_chats.jsonl", synthetic_chats(check.STAGE_CHATS, seed=2))
    sizing = plan.size_for(opts.device_memory or plan.device_gib() or plan.H200_GIB)
    for name, data, epochs, tokens in (
        ("stages", "stage_chats.jsonl", 1, sizing.stage_tokens),
        ("pipe", "pipeline_chats.jsonl", check.PIPELINE_EPOCHS, sizing.pipeline_tokens),
    ):
        if tokens is not None:  # None: no shape fits this device; the driver skips the stages that need it
            check.write_job(workdir / name / "job.toml", workdir / name, assets, data, epochs, tokens)
    size = sum(f.stat().st_size for f in assets.rglob("*") if f.is_file())
    return {
        "ok": True,
        "written_gib": round(size / 2**30, 2),
        "device_gib": sizing.device_gib,
        "stage_tokens": sizing.stage_tokens,
        "pipeline_tokens": sizing.pipeline_tokens,
    }


def _batches(workdir: Path):
    """The stage job's plan, packed as the producer packs it (producer.build.build_dataset)."""
    from common.config import load_job
    from producer.build import build_dataset
    from producer.prefetch import pack_batch

    job = load_job(workdir / "stages" / "job.toml")
    dataset, batch_plan = build_dataset(job, node_rank=0, nnodes=1)
    reader = dataset.reader()
    batches = [pack_batch(reader, planned) for planned in batch_plan.batches_from(0)]
    reader.close()
    if len(batches) <= check.WARMUP_BATCHES:
        raise RuntimeError(f"the plan has {len(batches)} batches, no more than the {check.WARMUP_BATCHES} of warm-up")
    return job, batches


def dynamo_counts() -> dict[str, int]:
    """Dynamo's own counters: frames compiled and graphs built. A graph built after the warm-up is a recompile
    (a guard failed on a new shape); torch keeps no counter of recompiles itself (counters["recompiles"] is
    never incremented), so the timed batches' graphs are the figure."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["ok"]), "graphs": int(counters["stats"]["unique_graphs"])}


def _timed(run, batches) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for b in batches:
        run(b)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def compile_split(warm_s: float, warm_tokens: int, run_s: float, run_tokens: int) -> dict:
    """compile_s: the warm-up's seconds beyond what its tokens cost at the timed rate (cold compiles of flex
    attention and block masks, Triton's autotune, first allocations); run_s: the timed batches."""
    extra = warm_s - warm_tokens * run_s / run_tokens
    return {"compile_s": round(max(extra, 0.0), 1), "run_s": round(run_s, 1), "warmup_s": round(warm_s, 1)}


def _compile_figures(before: dict, after_warmup: dict, after_timed: dict) -> dict:
    return {f"{k}_in_warmup": after_warmup[k] - before[k] for k in before} | {
        f"{k}_in_timed_batches": after_timed[k] - after_warmup[k] for k in before
    }


def stage_producer(workdir: Path, opts) -> dict:
    """The full-depth 8B-shaped target, random weights built on the GPU (no file): packed forwards into a
    slot-sized buffer; warm-up on the plan's first batches, timed on the batches after them (never seen)."""
    import torch
    from torch import nn
    from transformers import AutoModel

    from producer.target import TargetCapture, choose_attn_implementation

    job, batches = _batches(workdir)
    cut = plan.target_config()
    cut.num_hidden_layers = max(plan.LAYER_IDS) + 1
    torch.cuda.reset_peak_memory_stats()
    with torch.device("cuda"):
        model = AutoModel.from_config(cut, dtype=torch.bfloat16)
    model.set_attn_implementation(choose_attn_implementation(type(model), "auto", "cuda"))
    model.norm = nn.Identity()  # as producer.target.load_target cuts it
    target = TargetCapture(model.requires_grad_(False).eval(), model.config, plan.LAYER_IDS, plan.TARGET["num_layers"])
    buffer = torch.empty(job.data.tokens_per_batch, target.feature_width, dtype=torch.bfloat16, device="cuda")
    on_gpu = [(b.input_ids.cuda(), b.cu_seqlens, b.num_tokens) for b in batches]

    def run(b):
        target(b[0], b[1], out=buffer[: b[2]])

    warm, timed = on_gpu[: check.WARMUP_BATCHES], on_gpu[check.WARMUP_BATCHES :]
    c0 = dynamo_counts()
    warm_s = _timed(run, warm)
    c1 = dynamo_counts()
    seconds = _timed(run, timed)
    c2 = dynamo_counts()
    tokens = sum(b[2] for b in timed)
    return {
        **compile_split(warm_s, sum(b[2] for b in warm), seconds, tokens),
        "tokens_per_batch": job.data.tokens_per_batch,
        "ok": True,
        "timed_batches": len(timed),
        "timed_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "attn": target.attn_implementation,
        "gpu_mem_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        **_compile_figures(c0, c1, c2),
    }


def stage_consumer(workdir: Path, opts) -> dict:
    """One drafter's train_batch on the plan's batches with random features (the step's cost does not depend on
    their values); warm-up, then the unseen batches timed; then the NVML sampler on / off over the same
    batches. Nothing is saved (no checkpoint, no Adam state on disk)."""
    import logging

    import torch

    from consumer.trainer import Trainer
    from telemetry.nvml import NvmlSampler

    job, batches = _batches(workdir)
    t = plan.TARGET
    torch.cuda.reset_peak_memory_stats()
    embed = torch.randn(t["vocab_size"], t["hidden_size"], dtype=torch.bfloat16, device="cuda") * 0.02
    parts = plan.target_parts(workdir / "assets" / "target", embed, torch.randn_like(embed) * 0.02)
    # the job's tokens_per_batch sizes the anchor budget and flex's one compiled shape, as in the consumer
    start = time.perf_counter()
    trainer = Trainer(job.drafters[0], parts, plan.LAYER_IDS, "cuda:0", tokens_per_batch=job.data.tokens_per_batch)
    trainer.warmup()
    setup_s = time.perf_counter() - start
    features = torch.randn(
        job.data.tokens_per_batch, len(plan.LAYER_IDS) * t["hidden_size"], dtype=torch.bfloat16, device="cuda"
    )  # the copy-out buffer; each batch reads its first T rows

    def run(b):
        trainer.train_batch(
            features[: b.num_tokens], b.input_ids.cuda(), b.loss_mask, b.cu_seqlens, b.seq
        )  # masks: host

    warm, timed = batches[: check.WARMUP_BATCHES], batches[check.WARMUP_BATCHES :]
    c0 = dynamo_counts()
    warm_s = setup_s + _timed(run, warm)  # the trainer's build and the loss kernels' autotune count as compile
    c1 = dynamo_counts()
    seconds = _timed(run, timed)
    c2 = dynamo_counts()
    off = _timed(run, timed)
    sampler = NvmlSampler(job.telemetry.nvml_interval_s, logging.getLogger("gpu_check.nvml"))
    sampler.start()
    try:
        on = _timed(run, timed)
    finally:
        sampler.stop()
    tokens = sum(b.num_tokens for b in timed)
    return {
        **compile_split(warm_s, sum(b.num_tokens for b in warm), seconds, tokens),
        "tokens_per_batch": job.data.tokens_per_batch,
        "ok": True,
        "timed_batches": len(timed),
        "timed_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "nvml_on_over_off_step_time": round(on / off, 4),
        "nvml_available": sampler.available,
        "gpu_mem_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        **_compile_figures(c0, c1, c2),
    }


class NvmlPeak:
    """GPU memory used on device 0, sampled every `interval_s` in a thread; the peak, in GiB."""

    def __init__(self, interval_s: float = 0.5) -> None:
        import threading

        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nvml-peak", daemon=True)
        self.interval_s = interval_s
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.nv.nvmlDeviceGetMemoryInfo(self.handle).used)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        self.nv.nvmlShutdown()
        return round(self.peak / 2**30, 2)


def stage_pipeline(workdir: Path, opts) -> dict:
    """The real processes (telemetry with NVML, the producer, one consumer per drafter) on the small target
    checkpoint: tokens/s over telemetry's windows for PIPELINE_S seconds after the first trained window, the
    GPU's NVML peak; then SIGKILL (no checkpoint is written: no Adam state on disk)."""
    from common.config import load_job

    job_path = workdir / "pipe" / "job.toml"
    job = load_job(job_path)
    logs = workdir / "pipe" / "gpu-check-logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = check.with_root(dict(os.environ))
    env.pop("TRITON_INTERPRET", None)
    roles = [
        ("telemetry", ["-m", "telemetry", "--job", str(job_path)]),
        ("producer", ["-m", "producer", "--job", str(job_path)]),
    ]
    roles += [(d.name, ["-m", "consumer", "--job", str(job_path), "--drafter", d.name]) for d in job.drafters]
    peak = NvmlPeak()
    procs: dict[str, subprocess.Popen] = {}
    start = time.perf_counter()
    try:
        for name, args in roles:
            with open(logs / f"{name}.log", "wb") as out:
                procs[name] = subprocess.Popen(
                    [sys.executable, *args],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        metrics = job.run_paths.metrics_jsonl
        deadline = time.monotonic() + check.PIPELINE_START_S
        while not (metrics.exists() and window_figures(metrics)["windows"] > 0):  # the first trained window
            dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the pipeline did not start training in {check.PIPELINE_START_S} s (exited: {dead}); logs in {logs}"
                )
            time.sleep(1)
        started_s = time.perf_counter() - start
        time.sleep(check.PIPELINE_S)
        figures = window_figures(metrics)
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs.values():
            p.wait(30)
        mem = peak.stop()
    rates = [v for k, v in figures.items() if k.startswith("drafter/")]
    return {
        "ok": not dead and bool(rates),
        "exited_during_run": dead,
        "start_to_first_window_s": round(started_s, 1),
        "compile_s": round(started_s, 1),  # imports, the checkpoint's load, every process's compiles
        "run_s": check.PIPELINE_S,
        "tokens_per_batch": job.data.tokens_per_batch,
        "seconds": check.PIPELINE_S,
        **figures,
        "pipeline_tokens_per_s": min(rates) if rates else None,
        "gpu_mem_peak_gib": mem,
        "logs": str(logs),
    }


def stage_export(workdir: Path, opts) -> dict:
    """A one-layer drafter of the target's shape trained two steps, exported as the consumer exports it (weights
    and config only), reloaded with AutoModel.from_pretrained(trust_remote_code) and compared."""
    import torch
    import transformers
    from safetensors.torch import load_file

    from common.config import DrafterConfig
    from consumer.export.layout import export_config, write_export
    from consumer.target_parts import load_target_parts
    from consumer.trainer import Trainer

    parts = load_target_parts(workdir / "assets" / "target")
    cfg = DrafterConfig(name="export", num_layers=1, block_size=16, mask_token_id=0, devices=["cuda:0"])
    T = plan.EXPORT_TOKENS
    trainer = Trainer(cfg, parts, plan.PIPELINE_LAYER_IDS, "cuda:0", tokens_per_batch=T)
    ids = torch.randint(0, 2000, (T,), device="cuda")
    steps_s = []
    for seq in range(2):  # the first step compiles flex at this shape: its extra seconds are compile_s
        torch.cuda.synchronize()
        step_start = time.perf_counter()
        hidden = torch.randn(T, len(plan.PIPELINE_LAYER_IDS) * parts.hidden_size, dtype=torch.bfloat16, device="cuda")
        trainer.train_batch(
            hidden,
            ids,
            torch.ones(T, dtype=torch.uint8),  # loss_mask on the host
            torch.tensor([0, T // 2, T], dtype=torch.int32),
            seq,
        )
        torch.cuda.synchronize()
        steps_s.append(time.perf_counter() - step_start)
    out = Path(tempfile.mkdtemp(prefix="export-", dir=workdir))
    write_export(
        out,
        trainer.model.state_dict(),
        export_config(
            trainer.arch,
            trainer.parts,
            block_size=cfg.block_size,
            mask_token_id=trainer.mask_token_id,
            target_layer_ids=trainer.target_layer_ids,
            dtype=cfg.dtype,
        ),
    )
    model = transformers.AutoModel.from_pretrained(str(out), trust_remote_code=True, local_files_only=True)
    saved, state = load_file(str(out / "model.safetensors")), model.state_dict()
    same = all(k in state and torch.equal(state[k].cpu().to(v.dtype), v) for k, v in saved.items())
    return {
        "ok": same,
        "tensors": len(saved),
        "weights_equal": same,
        "compile_s": round(max(steps_s[0] - steps_s[1], 0.0), 1),
        "run_s": round(2 * steps_s[1], 1),
        "export_mib": round(sum(f.stat().st_size for f in out.iterdir()) / 2**20, 1),
    }


STAGES = {
    "ipc": stage_ipc,
    "imports": stage_imports,
    "tests": stage_tests,
    "memory": stage_memory,
    "assets": stage_assets,
    "producer": stage_producer,
    "consumer": stage_consumer,
    "pipeline": stage_pipeline,
    "export": stage_export,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check_stages", description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=sorted(STAGES))
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument(
        "--device-memory", type=float, default=None, help="GiB the shapes are sized to (default: the device's)"
    )
    ap.add_argument("--no-ipc", action="store_true", help="tests: leave out the files that need CUDA IPC")
    args = ap.parse_args(argv)
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr: stdout carries the one JSON line
    start = time.perf_counter()
    try:
        result = STAGES[args.stage](args.workdir, args)
    except Exception as err:  # the stage's failure is its figure: reported, and the others still run
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(err).__name__}: {str(err)[:300]}"}
    result = {"stage": args.stage, **result, "wall_s": round(time.perf_counter() - start, 1)}
    protocol.write(json.dumps(result) + "\n")
    protocol.flush()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
