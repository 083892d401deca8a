"""bench.pipeline's processes: JSON-line workers, the pipeline runs and the stats windows they are timed by.

A pipeline run sends one request to each pinned entry worker (bench.entry_worker: the producer's and
consumers' `main(argv)`), binds the telemetry ingest socket of the job's run directory and keeps every
stats snapshot the processes publish (one per batch). A process's window runs from its snapshot after
the last warm-up batch to its snapshot after the last batch: start-up, warm-up, the end of the stream
and the final checkpoint fall outside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import psutil
import zmq

from common.run_paths import RunPaths
from common.stats import StatsDecodeError, StatsPayload, decode_stats, ingest_endpoint

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 600.0


def child_env() -> dict[str, str]:
    """One thread per process (the two-thread serial baseline sets its own), passive OpenMP waits (a thread
    spinning at a barrier would burn the core its descheduled partner needs on a shared VM), no Triton
    interpreter (tests set it; the CPU trainer would run it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = [str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
        TRANSFORMERS_VERBOSITY="error",
    )
    return env


# ------------------------------------------------------------------------------------ worker processes


class Worker:
    """A child process spoken to in JSON lines: requests on its stdin, answers on its stdout."""

    def __init__(self, name: str, args: list[str], log: Path):
        self.name, self.log = name, log
        with open(log, "w") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *args],
                cwd=ROOT,
                env=child_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
            )
        self._buf = b""

    def send(self, request: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float) -> dict | None:
        """The next answer line, or None when none came within `timeout_s`; raises if the process died."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(
                    f"worker {self.name} exited ({self.proc.wait(timeout=30)}); {self.log}:\n{tail(self.log)}"
                )
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def request(self, request: dict | None, timeout_s: float = RUN_TIMEOUT_S) -> dict:
        if request is not None:
            self.send(request)
        got = self.answer(timeout_s)
        if got is None:
            raise RuntimeError(f"worker {self.name} gave no answer within {timeout_s:.0f} s to {request}")
        return got

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.send({"quit": True})
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


class LoadMeter:
    """CPU time the rest of the machine (other tenants, hypervisor steal) used meanwhile, in cores."""

    def __init__(self, workers):
        self.ours = [psutil.Process(), *(psutil.Process(w.proc.pid) for w in workers)]
        self.start = (time.monotonic(), self._busy(), self._ours())

    def _busy(self) -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - t.iowait - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def _ours(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self.ours)

    def stop(self) -> float:
        wall, busy, ours = self.start
        return (self._busy() - busy - (self._ours() - ours)) / (time.monotonic() - wall)


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


# ------------------------------------------------------------------------------------ pipeline runs


def run_pipeline(job: Path, drafters: int, workers: dict[str, Worker], warmup: int) -> dict:
    """One job to the end of its data: the producer's and consumers' main() in their pinned workers;
    rates from the stats snapshots they publish (this process binds the telemetry ingest socket)."""
    paths = RunPaths(job.parent)
    paths.make()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"stats.")
    sub.bind(ingest_endpoint(paths))
    roles = {"producer": ("producer.__main__", ["--job", str(job)])}
    roles |= {f"d{i}": ("consumer.__main__", ["--job", str(job), "--drafter", f"d{i}"]) for i in range(drafters)}
    load = LoadMeter(workers.values())
    for name, (module, argv) in roles.items():
        workers[name].send({"module": module, "argv": argv, "log": str(paths.logs / f"{name}.log")})
    snaps: dict[str, list[StatsPayload]] = {}
    affinity: dict[str, list[int]] = {}  # read from the kernel, per process that published
    status: dict[str, int] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while len(status) < len(roles):
            while sub.poll(50):
                try:
                    s = decode_stats(sub.recv_multipart())
                except StatsDecodeError as err:
                    raise RuntimeError(f"{job}: undecodable stats message: {err}") from err
                snaps.setdefault(s.name, []).append(s)
                if s.name not in affinity:
                    affinity[s.name] = sorted(os.sched_getaffinity(s.pid))
            for name in roles.keys() - status.keys():
                done = workers[name].answer(0)
                if done is not None:
                    status[name] = done["rc"]
            if time.monotonic() > deadline:
                raise RuntimeError(f"{job}: the pipeline did not finish within {RUN_TIMEOUT_S:.0f} s")
        while sub.poll(100):  # the final snapshots
            s = decode_stats(sub.recv_multipart())
            snaps.setdefault(s.name, []).append(s)
    finally:
        sub.close()
        ctx.term()
    failed = {name: rc for name, rc in status.items() if rc != 0}
    if failed:
        name = next(iter(failed))
        raise RuntimeError(f"{job}: {failed} exited non-zero; {name}'s log:\n{tail(paths.logs / f'{name}.log')}")
    windows = {"producer": window(snaps.get("producer", []), warmup, f"{job} producer")}
    windows |= {f"d{i}": window(snaps.get(f"d{i}_r0", []), warmup, f"{job} d{i}") for i in range(drafters)}
    # Each process's rate over the same batches on its own clock; the slowest is the pipeline's. The
    # consumers' alone would flatter it: the ring fills up during their warm-up, so their window starts
    # with batches made before it. The producer's window is not shortened by that.
    rates = {name: w["tokens"] / w["seconds"] for name, w in windows.items()}
    limited_by = min(rates, key=rates.__getitem__)
    producer, consumers = windows["producer"], [w for name, w in windows.items() if name != "producer"]
    train_keys = ("anchors", "forward", "backward", "optimizer")
    return {
        "tokens_per_s": rates[limited_by],
        "limited_by": limited_by,
        "window_tokens": min(w["tokens"] for w in windows.values()),  # = the stages' timed tokens
        "consumer_wait_batch_pct": 100 * max(w["timers"].get("wait_batch", 0.0) / w["seconds"] for w in consumers),
        "producer_wait_slot_pct": 100 * producer["timers"].get("wait_slot", 0.0) / producer["seconds"],
        "producer_forward_tokens_per_s": producer["tokens"] / producer["timers"]["forward"],
        "consumer_train_tokens_per_s": min(w["tokens"] / sum(w["timers"][k] for k in train_keys) for w in consumers),
        "producer_cpu_tokens_per_s": producer["tokens"] / producer["cpu_s"],
        # the drafter core's CPU per token: every consumer on it together
        "drafter_core_cpu_tokens_per_s": consumers[0]["tokens"] / sum(w["cpu_s"] for w in consumers),
        "target_core_busy_pct": 100 * producer["cpu_s"] / producer["seconds"],
        "drafter_core_busy_pct": 100 * sum(w["cpu_s"] / w["seconds"] for w in consumers),
        "other_load_cores": load.stop(),
        "affinity": affinity,
    }


def window(snaps: list[StatsPayload], warmup: int, who: str) -> dict:
    """Totals between the snapshot after batch `warmup` and the one after the last batch."""
    snaps = sorted((s for s in snaps if "batches" in s.counters), key=lambda s: s.seq)
    if not snaps:
        raise RuntimeError(f"{who}: no stats snapshot with a batch count arrived")
    last_count = snaps[-1].counters["batches"]
    start = next((s for s in snaps if s.counters["batches"] >= warmup), None)
    end = next(s for s in snaps if s.counters["batches"] == last_count)
    if start is None or end.counters["batches"] <= start.counters["batches"]:
        raise RuntimeError(f"{who}: no batches seen after the {warmup} warm-up batches (saw {last_count})")
    timers = {k: t["sum_s"] - start.timers.get(k, {"sum_s": 0.0})["sum_s"] for k, t in end.timers.items()}
    return {
        "tokens": end.counters["tokens"] - start.counters["tokens"],
        "seconds": end.mono_time - start.mono_time,
        "batches": end.counters["batches"] - start.counters["batches"],
        "timers": timers,
        "cpu_s": end.process["cpu_s"] - start.process["cpu_s"],
    }
