"""Tiny, fully local jobs for integration tests: a BPE tokenizer, a random Qwen3 target, chat data, a job file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import ROOT
from common.config import load_job
from common.ring_file import ring_path
from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl

_ASSETS: dict[str, Path] = {}


def run_ranks(argv, ranks: int = 2, timeout: float = 300.0) -> list[str]:
    """One gloo group run to its end: `python ARGV(rank, port)` for each rank, on one fresh loopback port, from
    the repository with one OpenMP thread; every rank must exit 0 (the outputs' tails name the one that did
    not). Returns their outputs."""
    port = harness.free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, *map(str, argv(rank, port))],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(ranks)
    ]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * ranks, "\n".join(f"rank {r}: {o[-3000:]}" for r, o in enumerate(outs))
    return outs


def launch(job: Path, *args: str, plan: Path | None = None) -> subprocess.Popen:
    """./launch.sh JOB ARGS as an operator runs it, in its own session (so a test can kill the whole group);
    `plan` replaces the job's processes by stand-ins (DFLASH_LAUNCH_PLAN_FILE)."""
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("DFLASH_LAUNCH_ID", None)
    if plan is not None:
        env["DFLASH_LAUNCH_PLAN_FILE"] = str(plan)
    return subprocess.Popen(
        [str(ROOT / "launch.sh"), str(job), *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """launch.sh's output once it returned; a launch.sh that does not return is a failure (and is killed)."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"launch.sh did not return within {timeout} s:\n{proc.communicate()[0]}") from None


def wait_all(procs: list[subprocess.Popen], timeout: float = 240) -> list[int]:
    """Every process's exit status; whatever still runs after `timeout` (or an error) is killed."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launch.sh ended while waiting for {what}:\n{proc.communicate()[0]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def tiny_assets(cache_dir: Path) -> Path:
    """Tokenizer + target + data, built once per test session (about 2.5 s of CPU) in the first `cache_dir`
    asked for; every later call shares that folder (tests only read it; each job has its own run folder)."""
    if "tiny" not in _ASSETS:
        cache_dir.mkdir(parents=True, exist_ok=True)
        records = list(synthetic_chats(240, seed=3))
        tok = train_tokenizer(corpus_texts(records), 400, cache_dir / "tokenizer")
        build_tiny_target(cache_dir / "target", tok, hidden_size=64, num_layers=6, seed=0)
        write_jsonl(cache_dir / "train.jsonl", records)
        _ASSETS["tiny"] = cache_dir
    return _ASSETS["tiny"]


def ring_file(job: Path, node: int = 0, replica: int = 0) -> Path:
    """The /dev/shm ring of this job's producer (target replica `replica` of node `node`)."""
    return ring_path("/dev/shm", load_job(job).ring_name(node, replica))


def remove_ring(job: Path, node: int = 0) -> None:
    """Remove the /dev/shm ring a SIGKILLed producer of this job left behind (a restart would remove it)."""
    ring_file(job, node).unlink(missing_ok=True)


def write_job(
    assets: Path,
    *,
    drafters: list[dict] | None = None,
    overrides: dict | None = None,
    tokens_per_batch: int = 512,
    epochs: int = 1,
    name: str = "tiny",
) -> Path:
    """A job file in a fresh short run dir under /tmp (ipc paths must stay under 107 characters), written from
    the validated config (bench/harness.py); `overrides` adds or replaces keys table by table."""
    run_dir = Path(tempfile.mkdtemp(prefix="dfj-", dir="/tmp"))
    doc = {
        "job": {"name": f"{name}-{run_dir.name[4:]}", "run_dir": str(run_dir), "seed": 7},
        "target": {"path": str(assets / "target"), "dtype": "float32", "num_features": 3},
        "data": {
            "path": str(assets / "train.jsonl"),
            "max_length": 256,
            "tokens_per_batch": tokens_per_batch,
            "epochs": epochs,
        },
        "transport": {"slots": 4, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "attach_timeout_s": 120},
        "telemetry": {"interval_s": 0.5, "window_s": 1.0, "wandb_mode": "offline"},
    }
    for table, keys in (overrides or {}).items():
        doc[table] = {**doc.get(table, {}), **keys}
    doc["drafters"] = drafters or [{"name": "d0"}]
    return harness.write_job(run_dir / "job.toml", doc)
