"""Real processes, real sockets: stand-in workers publish, the telemetry process aggregates, the CLI reads.

One job runs for the whole module (startup costs seconds on a 2-core machine): the tests that need it
live run first, then `finish()` stops the workers and telemetry and the totals are checked.
Run as a script (`python tests/telemetry/test_telemetry_integration.py worker ...`), this file is the stand-in worker.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import pytest
import zmq

ROOT = Path(__file__).resolve().parents[2]
WORKERS = [("producer", "producer"), ("consumer", "d0_r0"), ("consumer", "d0_r1")]
INTERVAL_S, WINDOW_S = 0.2, 0.5


def worker_main(argv: list[str]) -> None:
    """A producer or consumer stand-in: the timers, counters and gauges the real ones use."""
    sys.path.insert(0, str(ROOT))
    from common.config import load_job
    from common.profile import ProfileStats
    from common.stats import StatsPublisher, ingest_endpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--job")
    ap.add_argument("--role")
    ap.add_argument("--name")
    ap.add_argument("--stop-file")
    args = ap.parse_args(argv)
    job = load_job(args.job)
    prof = ProfileStats()
    pub = StatsPublisher(ingest_endpoint(job.run_paths), args.role, args.name, job.telemetry.interval_s, prof)
    deadline = time.monotonic() + 60.0  # never outlive a crashed test
    step = 0
    while not os.path.exists(args.stop_file) and time.monotonic() < deadline:
        step += 1
        tokens = 100 + step % 13
        if args.role == "producer":
            for key, seconds in (
                ("data", 0.0005),
                ("wait_slot", 0.001),
                ("forward", 0.003),
                ("write_slot", 0.0005),
            ):
                with prof.timer(key):
                    time.sleep(seconds)
            prof.count("tokens", tokens)
            prof.count("sequences", 4)
            prof.count("batches")
            prof.count("loss_tokens", tokens // 2)
            pub.maybe_publish(step=step, extra_gauges={"slots_in_use": float(step % 4)})
        else:
            for key, seconds in (
                ("wait_batch", 0.001),
                ("forward", 0.002),
                ("backward", 0.002),
                ("optimizer", 0.0005),
            ):
                with prof.timer(key):
                    time.sleep(seconds)
            prof.count("tokens", tokens)
            prof.count("anchors", 16)
            prof.count("batches")
            prof.count("steps")
            prof.gauge("loss", 10.0 / step)
            prof.gauge("lr", 1e-4)
            prof.gauge("tau_est", 3.5)
            pub.maybe_publish(step=step)
    pub.close(final=True)
    print(json.dumps(prof.snapshot()["counters"]), flush=True)


def python_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200", WANDB_SILENT="true")
    env.pop("WANDB_DIR", None)  # the run directory decides where W&B writes
    return env


def write_job(run_dir: Path, path: Path, wandb_mode: str = "offline") -> Path:
    from bench import harness

    return harness.write_job(
        path,
        {
            "job": {"name": "tjob", "run_dir": str(run_dir)},
            "target": {"path": "/nonexistent/target"},
            "data": {"path": "/nonexistent/data.jsonl"},
            "drafters": [{"name": "d0", "replicas": 2}],
            "telemetry": {
                "interval_s": INTERVAL_S,
                "window_s": WINDOW_S,
                "stale_after_s": 5.0,
                "wandb_mode": wandb_mode,
            },
        },
    )


def cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "telemetry.cli", *args],
        cwd=ROOT,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class LiveJob:
    def __init__(self, base: Path):
        self.run_dir = base / "run"
        self.job_file = write_job(self.run_dir, base / "job.toml")
        self.stop_file = base / "stop"
        self.telemetry_log = base / "telemetry.log"
        self.finished: dict | None = None
        with self.telemetry_log.open("w") as log:
            self.telemetry = subprocess.Popen(
                [sys.executable, "-m", "telemetry", "--job", str(self.job_file)],
                cwd=ROOT,
                env=python_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        worker = [
            sys.executable,
            __file__,
            "worker",
            "--job",
            str(self.job_file),
            "--stop-file",
            str(self.stop_file),
        ]
        self.workers = [
            subprocess.Popen(
                [*worker, "--role", role, "--name", name],
                cwd=ROOT,
                env=python_env(),
                stdout=subprocess.PIPE,
                text=True,
            )
            for role, name in WORKERS
        ]

    def metrics_docs(self) -> list[dict]:
        path = self.run_dir / "telemetry" / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_until_live(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            docs = self.metrics_docs()
            if docs and docs[-1]["health"]["sources_live"] == len(WORKERS):
                return
            assert self.telemetry.poll() is None, self.telemetry_log.read_text()
            time.sleep(0.2)
        raise AssertionError(f"workers never became live:\n{self.telemetry_log.read_text()}")

    def finish(self) -> dict:
        """Stop the workers (their final totals), then telemetry (its final window); once."""
        if self.finished is None:
            self.stop_file.touch()
            totals = {}
            for (role, name), proc in zip(WORKERS, self.workers, strict=True):
                out, _ = proc.communicate(timeout=60)
                assert proc.returncode == 0
                totals[f"{role}.{name}"] = json.loads(out.strip().splitlines()[-1])
            time.sleep(2 * WINDOW_S)  # a window or two after the final messages
            self.telemetry.send_signal(signal.SIGTERM)
            assert self.telemetry.wait(timeout=60) == 0, self.telemetry_log.read_text()
            self.finished = totals
        return self.finished

    def kill(self) -> None:
        for proc in [*self.workers, self.telemetry]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def live_job():
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="tl") as base:
        job = LiveJob(Path(base))
        try:
            job.wait_until_live()
            yield job
        finally:
            job.kill()


# ---- while the job runs ------------------------------------------------------------------------


def test_telemetry_process_has_no_cuda_or_torch(live_job):
    maps = Path(f"/proc/{live_job.telemetry.pid}/maps").read_text()
    assert "libtorch" not in maps and "libcuda" not in maps


def test_cli_once_shows_the_live_processes(live_job):
    out = cli(str(live_job.run_dir), "--once")
    assert out.returncode == 0, out.stderr
    for name in ("producer", "d0_r0", "d0_r1"):
        assert name in out.stdout
    assert "live" in out.stdout and "slots in use" in out.stdout


def test_cli_json_is_one_document_with_units_in_names(live_job):
    out = cli("--job", str(live_job.job_file), "--json")
    assert out.returncode == 0, out.stderr
    state = json.loads(out.stdout.strip().splitlines()[-1])
    procs = {p["source"]: p for p in state["processes"]}
    assert set(procs) == {f"{r}.{n}" for r, n in WORKERS}
    assert all(p["state"] == "live" for p in procs.values())
    assert procs["consumer.d0_r0"]["tokens_per_s"] > 0
    assert 0 <= procs["producer.producer"]["wait_pct"] <= 100
    assert state["ring"]["slots_total"] == 4
    assert state["health"]["nvml_available"] in (True, False)
    assert {"query_time", "window_s", "telemetry_uptime_s", "gpus", "pipeline"} <= set(state)


def test_malformed_messages_are_counted_not_fatal(live_job):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"ipc://{live_job.run_dir.resolve()}/sockets/telemetry-in.sock")
    assert sock.poll(10_000), "telemetry's subscription never arrived"
    sock.recv()
    garbage = [
        [b"stats.consumer.d0_r0", b"\xc1 not msgpack"],
        [b"stats.consumer.d0_r0"],
        [b"stats.consumer.d0_r0", msgpack.packb([1, 2, 3])],
        [b"stats.consumer.d0_r0", msgpack.packb({"v": 1, "role": "consumer"})],
    ]
    for frames in garbage:
        sock.send_multipart(frames)
    sock.close()
    deadline = time.monotonic() + 30
    while live_job.metrics_docs()[-1]["health"]["decode_errors"] < len(garbage):
        assert time.monotonic() < deadline, "decode errors never reported"
        time.sleep(0.2)
    assert live_job.metrics_docs()[-1]["health"]["decode_errors"] == len(garbage)
    assert live_job.telemetry.poll() is None
    seen = live_job.metrics_docs()[-1]["health"]["messages"]
    time.sleep(3 * WINDOW_S)
    assert live_job.metrics_docs()[-1]["health"]["messages"] > seen  # still ingesting


# ---- after the job ------------------------------------------------------------------------------


def test_window_deltas_add_up_to_what_workers_counted(live_job):
    totals = live_job.finish()
    docs = live_job.metrics_docs()
    for source, counters in totals.items():
        role, name = source.split(".")
        prefix = role if role == name else f"{role}/{name}"
        for key in ("tokens", "batches"):
            summed = sum(d["metrics"].get(f"{prefix}/{key}", 0) for d in docs)
            assert summed == counters[key], f"{source} {key}"
    rates = [d["metrics"]["consumer/d0_r0/tokens_per_s"] for d in docs if "consumer/d0_r0/tokens_per_s" in d["metrics"]]
    assert len(rates) >= 2 and all(r > 0 for r in rates)
    balances = [
        d["metrics"]["drafter/d0/replica_balance"] for d in docs if "drafter/d0/replica_balance" in d["metrics"]
    ]
    assert balances and all(0 < b <= 1 for b in balances)
    last = docs[-1]
    assert {s["source"]: s["state"] for s in last["sources"]} == {f"{r}.{n}": "exited" for r, n in WORKERS}
    assert last["health"]["gaps"] == 0


def test_wandb_offline_run_holds_what_was_published(live_job):
    from telemetry.wandb_reader import find_run_file, read_history, read_metric_definitions

    totals = live_job.finish()
    run_file = find_run_file(live_job.run_dir / "wandb")
    history = read_history(run_file)
    docs = live_job.metrics_docs()
    logged = [row["consumer/d0_r1/tokens"] for row in history if "consumer/d0_r1/tokens" in row]
    assert sum(logged) == totals["consumer.d0_r1"]["tokens"]
    written = [d["metrics"]["consumer/d0_r1/tokens"] for d in docs if "consumer/d0_r1/tokens" in d["metrics"]]
    assert logged == written
    defs = read_metric_definitions(run_file)
    assert defs["consumer/d0_r0/*"] == "consumer/d0_r0/step"
    assert defs["gpu/*"] == "telemetry/uptime_s"


def test_nvml_absence_is_logged_once_and_forwarding_continues(live_job):
    pynvml = pytest.importorskip("pynvml")
    live_job.finish()
    try:
        pynvml.nvmlInit()
        pytest.skip("NVML is present on this machine")
    except pynvml.NVMLError:
        pass
    log = live_job.telemetry_log.read_text()
    assert log.count("NVML unavailable") == 1
    docs = live_job.metrics_docs()
    assert all(d["gpus"] == [] for d in docs)
    assert sum(d["health"]["messages_window"] for d in docs) > 10


# ---- without a job ------------------------------------------------------------------------------


def test_cli_without_a_job_exits_nonzero_with_a_message(tmp_path):
    missing = cli(str(tmp_path / "nope"), "--once")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    no_socket = cli(str(tmp_path), "--json")
    assert no_socket.returncode == 2 and "no telemetry socket" in no_socket.stderr
    nothing = cli("--once")
    assert nothing.returncode == 2 and "RUN_DIR" in nothing.stderr


def test_cli_with_a_dead_telemetry_socket_times_out_nonzero(tmp_path):
    (tmp_path / "sockets").mkdir()
    (tmp_path / "sockets" / "telemetry-out.sock").touch()  # left behind by a killed telemetry
    out = cli(str(tmp_path), "--json", "--timeout", "0.5")
    assert out.returncode == 1 and "nothing published" in out.stderr
    assert out.stdout == ""


@pytest.mark.slow
def test_unreachable_wandb_server_falls_back_to_offline(tmp_path):
    script = f"""
import logging, sys
from pathlib import Path
from telemetry.sinks import WandbSink
logging.basicConfig(level=logging.INFO)
sink = WandbSink(mode="online", project="p", entity=None, root_dir=Path({str(tmp_path)!r}), group="g",
                 run_id="fallback", queue_size=4, log=logging.getLogger("t"), init_timeout_s=3.0)
sink.start()
sink.submit({{"telemetry/uptime_s": 1.0, "gpu/0/util_pct": 42.0}}, [])
sink.close(timeout_s=60)
print("mode", sink.mode_used)
"""
    env = dict(python_env(), WANDB_BASE_URL="http://127.0.0.1:9", WANDB_API_KEY="x" * 40, WANDB_MODE="online")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "mode offline" in out.stdout, out.stderr
    assert "trying offline" in out.stderr
    from telemetry.wandb_reader import find_run_file, read_history

    run_file = find_run_file(tmp_path / "wandb")
    assert "offline-run-" in str(run_file)
    (row,) = read_history(run_file)
    assert row["gpu/0/util_pct"] == 42.0


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker_main(sys.argv[2:])
