"""Several target replicas in one job, through launch.sh and real processes: every drafter replica is fed by
every producer (fan-in), each producer deals its batches among a drafter's live replicas, and exactly-once
accounting (common/accounting_check.py) holds through a SIGKILLed consumer, a SIGTERM and the reruns."""

import json
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.jobs import ROOT, finish, launch, ring_file, tiny_assets, wait_for, write_job

ONE = [
    {
        "name": "a",
        "block_size": 8,
        "num_layers": 1,
        "anchors_per_seq": 16,
        "loss_chunk_rows": 64,
        "checkpoint_every": 3,
        "log_every": 1,
    },
]
TWO = [
    *ONE,
    {
        "name": "b",
        "block_size": 4,
        "num_layers": 1,
        "anchors_per_seq": 8,
        "loss_chunk_rows": 64,
        "checkpoint_every": 2,
        "log_every": 1,
        "replicas": 2,
    },
]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


def replicated_job(assets: Path, drafters: list[dict], name: str) -> Path:
    job = write_job(assets, drafters=drafters, tokens_per_batch=1024, name=name)
    job.write_text(job.read_text().replace("num_features = 3", "num_features = 3\nreplicas = 2"))
    return job


def log_text(run: Path, name: str) -> str:
    path = run / "logs" / f"{name}.log"
    return path.read_text() if path.exists() else ""


def steps(run: Path, log: str, rank_name: str) -> int:
    lines = [li for li in log_text(run, log).splitlines() if f"{rank_name} step " in li]
    return int(lines[-1].split(" step ")[1].split()[0]) if lines else 0


def accounting_ok(run: Path, drafters: int) -> str:
    check = subprocess.run(
        [sys.executable, "-m", "common.accounting_check", str(run)], cwd=ROOT, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(": ok:") == drafters and check.stdout.count("; complete") == drafters, check.stdout
    return check.stdout


def cursor_records(run: Path) -> dict[str, list[dict]]:
    """Every checkpoint record of the job log, per drafter, oldest first (by the record's time: one file per
    consumer process, and their names carry pids, not an order): the group cursor each checkpoint carried."""
    out: dict[str, list[dict]] = {}
    for path in (run / "accounting").glob("consumer-*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line) if line.endswith("}") else {}
            if rec.get("kind") == "checkpoint":
                out.setdefault(rec["drafter"], []).append(rec)
    return {drafter: sorted(recs, key=lambda r: r["t"]) for drafter, recs in out.items()}


def delivered_by(run: Path) -> dict[str, int]:
    """Batches each producer's log says it made ("producer done (...): N batches")."""
    out = {}
    for name in ("producer", "producer-p1"):
        done = [li for li in log_text(run, name).splitlines() if "producer done (" in li]
        out[name] = int(done[-1].split("): ")[1].split()[0]) if done else 0
    return out


def test_two_producers_feed_one_drafter_replica_every_sample_once(assets):
    job = replicated_job(assets, ONE, "fanin")
    run = job.parent
    out = finish(launch(job, "--grace", "60"), 600)
    assert "started producer-p1 " in out and "started producer " in out, out
    accounting_ok(run, 1)
    made = delivered_by(run)
    assert made["producer"] > 0 and made["producer-p1"] > 0, made  # both shards fed the one replica
    assert not ring_file(job).exists() and not ring_file(job, replica=1).exists()


def test_two_producers_two_drafters_survive_a_sigkilled_consumer_and_a_sigterm(assets):
    job = replicated_job(assets, TWO, "fan2")
    run = job.parent
    procs = []
    try:
        first = launch(job, "--grace", "60")
        procs.append(first)
        wait_for(lambda: steps(run, "consumer-b-r1", "b_r1") >= 2, 300, "drafter b to train 2 steps", first)
        pid = subprocess.run(
            ["pgrep", "-g", str(first.pid), "-f", "--", "--drafter b --replica 1 "], capture_output=True, text=True
        ).stdout.split()
        os.kill(int(pid[0]), signal.SIGKILL)
        out = finish(first, 180)
        assert first.returncode != 0, out
        second = launch(job, "--grace", "60")  # the same command again: every process resumes from its checkpoint
        procs.append(second)
        before = log_text(run, "consumer-a-r0").count("a_r0 step ")
        wait_for(
            lambda: log_text(run, "consumer-a-r0").count("a_r0 step ") >= before + 2,
            300,
            "the rerun to train 2 steps of drafter a",
            second,
        )
        second.send_signal(signal.SIGTERM)
        out = finish(second, 180)
        assert second.returncode == 0, out
        third = launch(job, "--grace", "60")
        procs.append(third)
        out = finish(third, 600)
        assert third.returncode == 0, out
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    accounting_ok(run, 2)
    # one cursor per producer; above it only what was in flight from that producer (slots × the drafter's
    # replicas at most), in every checkpoint through the kill and the reruns
    records, slots = cursor_records(run), tomllib.loads(job.read_text())["transport"]["slots"]
    for drafter, replicas in (("a", 1), ("b", 2)):
        assert records[drafter] and all(r["producers"] == 2 and len(r["cursors"]) == 2 for r in records[drafter])
        assert max(len(a) for r in records[drafter] for a in r["trained_above"]) <= slots * replicas, records[drafter]
    b_logs = log_text(run, "consumer-b-r0") + log_text(run, "consumer-b-r1")
    assert b_logs.count("b_r0 step ") > 0 and b_logs.count("b_r1 step ") > 0


def test_two_tp2_replicas_through_launch_sh_train_every_sample_once(assets):
    """The worked example's shape on the CPU: 2 target replicas × TP 2 (four producer processes) → 1 drafter."""
    job = replicated_job(assets, ONE, "tpx2")
    job.write_text(job.read_text().replace("replicas = 2", "replicas = 2\ntp_size = 2", 1))
    run = job.parent
    proc = launch(job, "--grace", "60")
    out = finish(proc, 600)
    assert proc.returncode == 0, out
    accounting_ok(run, 1)
    made = delivered_by(run)
    for follower, producer in (("producer-tp1", "producer"), ("producer-p1-tp1", "producer-p1")):
        assert f"rank 0 ended the group after {made[producer]} forwards" in log_text(run, follower)
    assert min(made.values()) > 0


def test_a_checkpoint_of_one_producer_resumes_under_two_exactly(assets):
    """target.replicas changes between runs: the seqs are the node plan's, so the first run's trained seqs
    are re-dealt to the two producers' cursors and every sample is still trained once."""
    job = write_job(assets, drafters=ONE, tokens_per_batch=1024, name="regroup")
    run = job.parent
    first = launch(job, "--grace", "60")
    try:
        wait_for(lambda: steps(run, "consumer-a-r0", "a_r0") >= 4, 300, "drafter a to train 4 steps", first)
        first.send_signal(signal.SIGTERM)
        out = finish(first, 180)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0, out
    stopped = cursor_records(run)["a"]
    assert stopped and all(r["producers"] == 1 for r in stopped)
    job.write_text(job.read_text().replace("num_features = 3", "num_features = 3\nreplicas = 2"))
    second = launch(job, "--grace", "60")
    out = finish(second, 600)
    assert second.returncode == 0, out
    assert "this run has 2: its trained seqs are re-dealt" in log_text(run, "consumer-a-r0")
    accounting_ok(run, 1)
    assert cursor_records(run)["a"][-1]["producers"] == 2 and min(delivered_by(run).values()) > 0
