"""The soak's job and process group: a tiny local job, a systemd-like supervisor, and a watch on the run folder.

The watch reads only what the processes write anyway: the job log (accounting/), per-process logs,
telemetry's metrics.jsonl and the checkpoints, so the soak measures the system as an operator sees it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import harness
from common.accounting import ACCOUNTING_DIR
from common.config import JobConfig
from common.stats import ingest_endpoint
from consumer.checkpoint import load_latest
from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
RESTART_S = 1.0  # systemd's RestartSec (the units use 10 s; shorter here so faults come faster)
POLL_S = 0.1
DRAFTER = {
    "num_layers": 1,
    "anchors_per_seq": 16,
    "loss_chunk_rows": 64,
    "checkpoint_every": 10,
    "log_every": 50,
    "total_steps": 100000,
}


def build_job(root: Path, seed: int) -> Path:
    """Tokenizer, random target, chat data and a two-drafter job file under `root` (about a second)."""
    assets = root / "assets"
    records = list(synthetic_chats(240, seed=3))
    tok = train_tokenizer(corpus_texts(records), 400, assets / "tokenizer")
    build_tiny_target(assets / "target", tok, hidden_size=64, num_layers=6, seed=0)
    write_jsonl(assets / "train.jsonl", records)
    return harness.write_job(
        root / "job.toml",
        {
            "job": {"name": f"soak-{secrets.token_hex(3)}", "run_dir": str(root / "run"), "seed": seed},
            "target": {"path": str(assets / "target"), "dtype": "float32", "num_features": 3},
            "data": {"path": str(assets / "train.jsonl"), "max_length": 256, "tokens_per_batch": 512, "epochs": 400},
            "transport": {
                "slots": 4,
                "heartbeat_interval_s": 0.2,
                "heartbeat_timeout_s": 2.0,
                "attach_timeout_s": 300,
                "on_dead_group": "skip",
            },
            "telemetry": {"interval_s": 0.5, "window_s": 1.0, "stale_after_s": 3.0, "wandb_mode": "disabled"},
            "drafters": [{"name": "d0", "block_size": 8, **DRAFTER}, {"name": "d1", "block_size": 4, **DRAFTER}],
        },
    )


class Proc:
    """One supervised process; `policy`: "always" | "on-failure" | "never" (systemd's Restart=)."""

    def __init__(self, name: str, argv: list[str], log_path: Path, policy: str):
        self.name, self.argv, self.log_path, self.policy = name, argv, log_path, policy
        self.popen: subprocess.Popen | None = None
        self.starts: list[float] = []
        self.exits: list[tuple[float, int, int]] = []  # (time, pid, status)
        self.restart_at: float | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(self.log_path, "a") as out:
            self.popen = subprocess.Popen(
                [sys.executable, *self.argv], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        self.starts.append(time.time())

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait_exit(self, pid: int, timeout: float) -> float:
        """Time at which process `pid` (one incarnation of this service) exited."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, p, _status in self.exits:
                if p == pid:
                    return t
            time.sleep(POLL_S)
        raise TimeoutError(f"{self.name} (pid {pid}) did not exit within {timeout:.0f} s")


class Supervisor:
    def __init__(self, job: JobConfig, job_path: Path, log):
        self.job, self.job_path, self.log = job, job_path, log
        job.run_paths.make()
        logs = job.run_paths.logs
        jp = str(job_path)
        self.procs = {
            "telemetry": Proc("telemetry", ["-m", "telemetry", "--job", jp], logs / "telemetry.log", "always"),
            # Restart=on-failure, as deploy/systemd/dflash-producer.service: a killed producer comes back and
            # the consumers (which checkpointed and exited when they lost it) resume from their checkpoints
            "producer": Proc("producer", ["-m", "producer", "--job", jp], logs / "producer.log", "on-failure"),
        }
        for d in job.drafters:
            name = f"consumer-{d.name}"
            self.procs[name] = Proc(
                name, ["-m", "consumer", "--job", jp, "--drafter", d.name], logs / f"{name}.log", "on-failure"
            )
        self.consumers = [n for n in self.procs if n.startswith("consumer-")]
        self.stopping = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._monitor, name="supervisor", daemon=True)

    def start(self) -> None:
        for p in self.procs.values():
            p.start()
        self._thread.start()

    def _monitor(self) -> None:
        while True:
            now = time.time()
            with self._lock:
                for p in self.procs.values():
                    if p.popen is None:
                        continue
                    status = p.popen.poll()
                    if status is not None and p.restart_at is None and (not p.exits or p.exits[-1][1] != p.pid):
                        p.exits.append((now, p.pid, status))
                        self.log(f"  {p.name} (pid {p.pid}) exited with status {status}")
                        if not self.stopping and (p.policy == "always" or (p.policy == "on-failure" and status)):
                            p.restart_at = now + RESTART_S
                        elif p.name == "producer" and not self.stopping:
                            self.log("  the producer ended: the job cannot go on")
                    if p.restart_at is not None and now >= p.restart_at and not self.stopping:
                        p.restart_at = None
                        p.start()
                        self.log(f"  restarted {p.name} as pid {p.pid}")
            time.sleep(POLL_S)

    def start_again(self, name: str) -> None:
        """Start a service that exited cleanly (which Restart=on-failure leaves down), as an operator would."""
        with self._lock:
            p = self.procs[name]
            if not p.alive() and p.restart_at is None:
                p.start()
                self.log(f"  started {p.name} again as pid {p.pid}")

    def restart_counts(self) -> dict[str, int]:
        return {n: len(p.starts) - 1 for n, p in self.procs.items()}

    def stop_all(self) -> dict[str, int]:
        """SIGTERM the consumers (they checkpoint and say BYE), then the producer, then telemetry."""
        with self._lock:
            self.stopping = True
        codes = {}
        for names, grace in ((self.consumers, 120), (["producer"], 60), (["telemetry"], 30)):
            for n in names:
                if self.procs[n].alive():
                    self.procs[n].popen.send_signal(signal.SIGTERM)
            for n in names:
                try:
                    codes[n] = self.procs[n].popen.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    codes[n] = -1
        return codes

    def pause(self) -> dict[str, int]:
        """Stop the whole job as stop_all does, to hand the run folder to launch.sh for a while."""
        return self.stop_all()

    def resume(self) -> None:
        """Start every service again after `pause` (systemd starting the target again)."""
        with self._lock:
            self.stopping = False
            for p in self.procs.values():
                p.restart_at = None
                p.start()
            self.log("  every service started again")

    def kill_all(self) -> None:
        self.stopping = True
        for p in self.procs.values():
            if p.alive():
                os.kill(p.pid, signal.SIGCONT)
                p.popen.kill()
                p.popen.wait(timeout=30)


class JobWatch:
    """What the run folder says: training steps and deliveries (job log), log lines, telemetry windows."""

    def __init__(self, job: JobConfig, sup: Supervisor):
        self.job, self.sup = job, sup
        self.paths = job.run_paths
        self._offsets: dict[Path, int] = {}
        self._steps: dict[str, list[tuple[float, int]]] = {}  # drafter -> (time, pid) of each step record
        self._deliveries: list[float] = []

    def _scan(self) -> None:
        for path in sorted((self.paths.root / ACCOUNTING_DIR).glob("*.jsonl")):
            start = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
            end = data.rfind(b"\n") + 1  # whole lines only
            self._offsets[path] = start + end
            pid = int(path.name.rsplit("-", 2)[-2])
            for line in data[:end].splitlines():
                rec = json.loads(line)
                if rec["kind"] == "step":
                    self._steps.setdefault(rec["drafter"], []).append((rec["t"], pid))
                elif rec["kind"] == "batch":
                    self._deliveries.append(rec["t"])

    def _wait(self, find, timeout: float, what: str) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._scan()
            t = find()
            if t is not None:
                return t
            time.sleep(0.2)
        raise TimeoutError(f"no {what} within {timeout:.0f} s")

    def wait_step(self, consumer: str, after: float, timeout: float, not_pid: int | None = None) -> float:
        """Time of the first training step of `consumer` after `after` (by another pid than `not_pid`)."""
        drafter = consumer.removeprefix("consumer-")

        def find():
            return next((t for t, pid in self._steps.get(drafter, []) if t > after and pid != not_pid), None)

        return self._wait(find, timeout, f"training step of {drafter}")

    def wait_attached(
        self, consumer: str, after: float, timeout: float, pid: int | None = None, not_pid: int | None = None
    ) -> float:
        """Time the producer logged `consumer` (by `pid`, or by another pid than `not_pid`) attached after `after`."""
        drafter = consumer.removeprefix("consumer-")
        found = re.compile(rf"^(\S+ \S+),(\d+) producer INFO {drafter}\.r0 \(pid (\d+)\) attached", re.M)

        def find():
            for m in found.finditer(self._log("producer")):
                t = time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000
                who = int(m[3])
                if t > after and (pid is None or who == pid) and who != not_pid:
                    return t
            return None

        return self._wait(find, timeout, f"attachment of {drafter}")

    def count_deliveries(self) -> int:
        """Batch records in the job log so far."""
        self._scan()
        return len(self._deliveries)

    def wait_delivery(self, after: float, timeout: float) -> float:
        return self._wait(lambda: next((t for t in self._deliveries if t > after), None), timeout, "delivery")

    def wait_window(self, after: float, sources: int, timeout: float) -> float:
        """Time of the first telemetry window after `after` in which `sources` processes are live."""
        path = self.paths.metrics_jsonl

        def find():
            if not path.exists():
                return None
            for line in path.read_text().splitlines()[-50:]:
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill
                if doc["time"] > after and doc["health"]["sources_live"] >= sources:
                    return doc["time"]
            return None

        return self._wait(find, timeout, f"telemetry window with {sources} live sources")

    def windows(self, after: float) -> list[dict]:
        """Telemetry's windows written after `after` (whole lines only)."""
        path = self.paths.metrics_jsonl
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if doc["time"] > after:
                doc["_bytes"] = len(line)
                out.append(doc)
        return out

    def wait_only_live(self, after: float, sources: int, timeout: float) -> float:
        """Time of the first window after `after` that holds exactly `sources` sources, all live."""

        def find():
            return next(
                (
                    d["time"]
                    for d in self.windows(after)
                    if len(d["sources"]) == sources and all(s["state"] == "live" for s in d["sources"])
                ),
                None,
            )

        return self._wait(find, timeout, f"telemetry window with only the {sources} live sources")

    def telemetry_decode_errors(self) -> int:
        """The running telemetry process's count of malformed stats messages (its last window)."""
        path = self.paths.metrics_jsonl
        for line in reversed(path.read_text().splitlines() if path.exists() else []):
            try:
                return int(json.loads(line)["health"]["decode_errors"])
            except (json.JSONDecodeError, KeyError):
                continue
        return 0

    def _log(self, name: str) -> str:
        path = self.paths.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def count(self, name: str, text: str) -> int:
        return self._log(name).count(text)

    def count_all(self, text: str) -> int:
        return sum(self.count(n, text) for n in self.sup.procs)

    def tail(self, name: str, lines: int) -> str:
        return "\n".join(self._log(name).splitlines()[-lines:])

    def control_endpoint(self) -> str:
        return (self.paths.sockets / "control.endpoint").read_text().strip()

    def ingest_endpoint(self) -> str:
        return ingest_endpoint(self.paths)

    def ckpt_dir(self, drafter: str) -> Path:
        return self.paths.checkpoints(drafter)

    def latest_checkpoint(self, drafter: str) -> tuple[str, int] | None:
        """(name, step) of the checkpoint `latest` names, fully loaded: a damaged one raises."""
        ckpt = load_latest(self.ckpt_dir(drafter))
        return None if ckpt is None else (ckpt.path.name, ckpt.step)
