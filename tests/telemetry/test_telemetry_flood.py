"""Telemetry under a flooding publisher (issue 24 item 7), real processes and sockets.

Found from outside: a local publisher flooding the stats socket (55–77k messages/s for 10–20 s, a new source
name in each) left 16–20k sources in telemetry forever: memory 44 → 181 MB and never back, every later window
5 MB (metrics.jsonl 280 MB), `dflash-stats` blind for the rest of the job ("sources has 20005 entries (at most
4096)"), and the pipeline slowed to a third while telemetry burned the CPU.
Here: the real telemetry process, one well-behaved publisher (a stand-in worker), and a flooder process that
sends as fast as it can for FLOOD_S over ipc, half the messages under new names, half under one name. Then:
the sources kept stay at the cap during the flood and go back to the real one after it, the real one stays
live throughout, memory is back, every metrics.jsonl line is small, and dflash-stats works."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from bench import harness
from telemetry.aggregate import FORGET_AFTER_STALE, MAX_SOURCES
from telemetry.service import INGEST_PER_S
from tests.telemetry.test_telemetry_integration import ROOT, cli, python_env

FLOOD_S = 6.0
STALE_AFTER_S = 1.0
MAX_LINE_BYTES = 400_000  # a window of MAX_SOURCES small sources; the flood made 5 MB lines before
pytestmark = pytest.mark.slow

FLOODER = """
import sys, time, zmq
from common.stats import StatsPayload, encode_stats
endpoint, seconds = sys.argv[1], float(sys.argv[2])
sock = zmq.Context().socket(zmq.XPUB)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.SNDHWM, 1000)
sock.connect(endpoint)
assert sock.poll(30_000), "telemetry never subscribed"
sent = 0  # an XPUB drops what its full pipe cannot take, silently: sent is what was offered
end = time.monotonic() + seconds
while time.monotonic() < end:
    for _ in range(200):
        name = f"f{sent}" if sent % 2 else "hog"
        p = StatsPayload(role="consumer", name=name, pid=4242, host="h", seq=sent, wall_time=time.time(),
                         mono_time=time.monotonic(), uptime_s=1.0, step=sent, final=False, timers={},
                         gpu_timers={}, counters={"tokens": float(sent)}, gauges={}, cuda_memory={},
                         cuda_device=None, gpu_uuid=None, process={"cpu_s": 0.0, "rss_bytes": 1})
        sock.send_multipart(encode_stats(p), zmq.NOBLOCK)
        sent += 1
print(sent)
"""


def write_job(run_dir: Path, path: Path) -> Path:
    return harness.write_job(
        path,
        {
            "job": {"name": "flood", "run_dir": str(run_dir)},
            "target": {"path": "/nonexistent/target"},
            "data": {"path": "/nonexistent/data.jsonl"},
            "drafters": [{"name": "d0"}],
            "telemetry": {"interval_s": 0.2, "window_s": 0.5, "stale_after_s": STALE_AFTER_S, "wandb_mode": "disabled"},
        },
    )


def docs(run_dir: Path) -> list[dict]:
    path = run_dir / "telemetry" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_doc(run_dir: Path, pred, timeout_s: float, what: str) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [d for d in docs(run_dir) if pred(d)]
        if found:
            return found[-1]
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_flooding_publisher_leaves_telemetry_small_and_the_real_sources_live():
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="tf") as base:
        base = Path(base)
        run_dir = base / "run"
        job = write_job(run_dir, base / "job.toml")
        stop_file = base / "stop"
        env = python_env()
        with (base / "telemetry.log").open("w") as out:
            telemetry = subprocess.Popen(
                [sys.executable, "-m", "telemetry", "--job", str(job)],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        worker = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "telemetry" / "test_telemetry_integration.py"),
                "worker",
                "--job",
                str(job),
                "--stop-file",
                str(stop_file),
                "--role",
                "consumer",
                "--name",
                "d0_r0",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            live = wait_doc(run_dir, lambda d: d["health"]["sources_live"] == 1, 60, "the worker to be live")
            proc = psutil.Process(telemetry.pid)
            rss_before = proc.memory_info().rss
            flood_started = time.time()
            flooder = subprocess.run(
                [sys.executable, "-c", FLOODER, f"ipc://{run_dir}/sockets/telemetry-in.sock", str(FLOOD_S)],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert flooder.returncode == 0, flooder.stderr
            sent = int(flooder.stdout)
            during = [d for d in docs(run_dir) if flood_started + 1.0 <= d["time"] <= time.time()]
            after = wait_doc(
                run_dir,
                lambda d: d["time"] > time.time() - 0.6 and len(d["sources"]) == 1,
                FORGET_AFTER_STALE * STALE_AFTER_S + 30,
                "the flood's sources to be forgotten",
            )
            rss_after = proc.memory_info().rss
            stats = cli(str(run_dir), "--json", "--timeout", "30")
        finally:
            stop_file.touch()
            worker.wait(60)
            telemetry.terminate()
            telemetry.wait(60)
        lines = (run_dir / "telemetry" / "metrics.jsonl").read_text().splitlines()
        log = (base / "telemetry.log").read_text()
    assert sent > INGEST_PER_S * FLOOD_S, sent  # a flood: more than telemetry may handle meanwhile
    assert during, "no window during the flood"
    kept = max(len(d["sources"]) for d in during)
    assert kept <= MAX_SOURCES
    assert all(any(s["source"] == "consumer.d0_r0" and s["state"] == "live" for s in d["sources"]) for d in during)
    health = after["health"]
    assert health["sources_refused"] > 0 and health["rate_limited"] > 0 and health["throttled_ticks"] > 0, health
    assert health["sources_forgotten"] >= MAX_SOURCES - 1, health
    assert f"telemetry keeps at most {MAX_SOURCES} sources" in log
    handled = sum(json.loads(line)["health"]["messages_window"] for line in lines)  # every message it read
    assert handled <= INGEST_PER_S * (json.loads(lines[-1])["uptime_s"] + 1), handled  # the budget held
    assert [s["source"] for s in after["sources"]] == ["consumer.d0_r0"] and live["sources"][0]["state"] == "live"
    assert max(map(len, lines)) < MAX_LINE_BYTES, max(map(len, lines))
    assert rss_after - rss_before < 30 << 20, (rss_before, rss_after)
    assert stats.returncode == 0, stats.stderr
    view = json.loads(stats.stdout)
    assert [p["name"] for p in view["processes"]] == ["d0_r0"] and view["processes"][0]["state"] == "live"
    print(
        f"flood: {sent} sent in {FLOOD_S} s; sources kept at most {kept}; "
        f"rss {rss_before >> 20} -> {rss_after >> 20} MiB; longest line {max(map(len, lines))} bytes; "
        f"health {json.dumps({k: health[k] for k in ('messages', 'sources_refused', 'rate_limited', 'sources_evicted', 'sources_forgotten', 'throttled_ticks')})}",
        file=sys.stderr,
    )
