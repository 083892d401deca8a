"""Foundation end to end: a real producer process and real consumer processes over the slot ring."""

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from bench import harness
from bench.harness import write_job
from tests.jobs import ring_file


def job_doc(name: str, run_dir: Path) -> dict:
    return {
        "job": {"name": name, "run_dir": str(run_dir)},
        "target": {"path": "/nonexistent-target", "dtype": "float32"},
        "data": {"path": "unused.jsonl", "max_length": 64, "tokens_per_batch": 256},
        "transport": {"slots": 4, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.5, "attach_timeout_s": 60},
        "drafters": [{"name": "d0"}, {"name": "d1", "replicas": 2}],
    }


@pytest.fixture
def job(request):
    run_dir = Path(tempfile.mkdtemp(prefix="dft-", dir="/tmp"))
    name = f"t{os.getpid()}{abs(hash(request.node.name)) % 10_000}"
    path = write_job(run_dir / "job.toml", job_doc(name, run_dir))
    yield path, run_dir
    ring_file(path).unlink(missing_ok=True)  # left by a SIGKILLed producer
    if not os.environ.get("KEEP_TEST_RUNS"):
        subprocess.run(["rm", "-rf", str(run_dir)], check=False)


def side(*args, log: Path):
    """One side of tests/procs/transport_pair.py."""
    return harness.spawn(["-m", "tests.procs.transport_pair", *args], log)


def read(path):
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def count(path):
    return len((read(path) or {"seqs": []})["seqs"])


def wait_until(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_500_batches_reach_every_group_exactly_once_intact(job):
    path, run = job
    n = 500
    procs = [side("producer", path, n, run / "p.json", log=run / "p.log")]
    members = [("d0", 0), ("d1", 0), ("d1", 1)]
    procs += [side("consumer", path, d, r, run / f"{d}{r}.json", log=run / f"{d}{r}.log") for d, r in members]
    try:
        for p in procs:
            assert p.wait(timeout=180) == 0, (run / "p.log").read_text()[-3000:]
    finally:
        for p in procs:
            p.kill()
    res = {m: read(run / f"{m[0]}{m[1]}.json") for m in members}
    assert all(r["done"] and r["bad"] == [] for r in res.values())
    assert sorted(res["d0", 0]["seqs"]) == list(range(n))
    d1 = res["d1", 0]["seqs"] + res["d1", 1]["seqs"]
    assert sorted(d1) == list(range(n))  # the two replicas split the stream, nothing twice
    assert len(res["d1", 0]["seqs"]) > 100 and len(res["d1", 1]["seqs"]) > 100  # round-robin
    prod = read(run / "p.json")
    assert prod["status"] == 0 and prod["batches"] == n and prod["in_use"] == 0 and prod["fenced"] == 0
    assert not Path(prod["ring_path"]).exists()  # the creator removed its shared memory


def test_killed_consumer_is_fenced_a_restarted_one_continues_and_a_killed_producer_ends_them_with_3(job):
    """One job for both faults (CI time): a SIGKILLed consumer is fenced and its restart continues; then the
    producer is SIGKILLed and every consumer left exits 3 with a message, within the heartbeat timeout."""
    path, run = job
    n = 100_000  # more than the test will consume
    prod = side("producer", path, n, run / "p.json", log=run / "p.log")
    d0 = side("consumer", path, "d0", 0, run / "d0.json", log=run / "d0.log")
    d1 = [side("consumer", path, "d1", r, run / f"d1{r}.json", log=run / f"d1{r}.log") for r in (0, 1)]
    procs = [prod, d0, *d1]
    try:
        wait_until(lambda: count(run / "d10.json") > 50, 120, "d1.r0 to train 50 batches")
        d1[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: "fenced d1.r0" in (run / "p.log").read_text(), 10, "the producer to fence d1.r0")
        fenced_after = time.monotonic() - killed
        assert fenced_after < 1.5 + 1.0  # heartbeat timeout + slack (ipc usually reports at once)
        before = count(run / "d11.json")
        wait_until(lambda: count(run / "d11.json") > before + 50, 60, "d1.r1 to go on alone")
        restarted = side("consumer", path, "d1", 0, run / "d10b.json", log=run / "d10b.log")
        procs.append(restarted)
        wait_until(lambda: count(run / "d10b.json") > 20, 60, "restarted d1.r0")
        for name in ("d0", "d11", "d10b"):
            assert read(run / f"{name}.json")["bad"] == []

        flowing = {name: count(run / f"{name}.json") for name in ("d0", "d11", "d10b")}
        wait_until(lambda: all(count(run / f"{k}.json") > v for k, v in flowing.items()), 60, "batches to flow")
        prod.send_signal(signal.SIGKILL)
        killed = time.time()
        for c in (d0, d1[1], restarted):
            assert c.wait(timeout=30) == 3
        for name in ("d0", "d11", "d10b"):
            line = next(li for li in (run / f"{name}.log").read_text().splitlines() if li.startswith("LOST_AT"))
            assert "lost the producer" in line
            assert float(line.split()[1].rstrip(":")) - killed < 1.5 + 1.0  # heartbeat timeout + slack
    finally:
        for p in procs:
            p.kill()
            p.wait()
