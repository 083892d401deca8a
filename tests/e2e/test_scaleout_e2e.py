"""Replica groups with the real processes (CPU, gloo, loopback): two replicas on one node, two simulated
nodes (two producers on two data shards, two run directories), and a replica killed then the group resumed.

Every consumer writes a step trace (--trace): per optimizer step the seqs and samples it trained and a
digest of its parameters; the tests compare those across replicas and against the producers' streams.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bench.harness import free_port, spawn
from consumer.checkpoint import load_latest
from tests.jobs import tiny_assets, wait_all, write_job

SAMPLES = 240  # tiny_assets' chats
pytestmark = pytest.mark.slow


def drafter(replicas: int, checkpoint_every: int = 10, distributed: str = "ddp") -> list[dict]:
    return [
        {
            "name": "d0",
            "distributed": distributed,
            "block_size": 8,
            "num_layers": 1,
            "anchors_per_seq": 16,
            "loss_chunk_rows": 64,
            "checkpoint_every": checkpoint_every,
            "log_every": 5,
            "total_steps": 400,
            "replicas": replicas,
        }
    ]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


def producer(job: Path, log: Path, node: int = 0, nnodes: int = 1) -> subprocess.Popen:
    return spawn(["-m", "producer", "--job", job, "--node-rank", node, "--nnodes", nnodes], log)


def consumer(
    job: Path, log: Path, trace: Path, port: int, *, replica: int, replicas: int, node: int = 0, nnodes: int = 1
) -> subprocess.Popen:
    return spawn(
        [
            "-m",
            "consumer",
            "--job",
            job,
            "--drafter",
            "d0",
            "--replica",
            replica,
            "--node-rank",
            node,
            "--nnodes",
            nnodes,
            "--trace",
            trace,
            "--dist-timeout",
            "60",
        ],
        log,
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(replicas * nnodes),
            "RANK": str(node * replicas + replica),
            "LOCAL_RANK": str(replica),
        },
    )


def tail(*logs: Path) -> str:
    return "\n".join(f"== {p}\n" + p.read_text()[-3000:] for p in logs if p.exists())


def planned(producer_log: Path) -> int:
    line = next(li for li in producer_log.read_text().splitlines() if "batches planned" in li)
    return int(line.split()[-3])  # "...; N batches planned"


def read_trace(path: Path) -> list[dict]:
    return [json.loads(li) for li in path.read_text().splitlines()]


def assert_identical_replicas(traces: list[list[dict]]) -> None:
    """Same steps, and after every step the same parameter bits on every replica."""
    steps = [[t["step"] for t in tr] for tr in traces]
    assert all(s == steps[0] for s in steps) and steps[0] == list(range(steps[0][0], steps[0][0] + len(steps[0])))
    for rows in zip(*traces, strict=True):
        assert len({r["digest"] for r in rows}) == 1, rows


def seqs_of(*traces: list[dict]) -> list[int]:
    return sorted(s for tr in traces for row in tr for s in row["seqs"])


@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
def test_two_replicas_hold_identical_parameters_and_train_the_stream_exactly_once(assets, tmp_path, distributed):
    """Two replicas, one producer; SIGTERM to one replica stops the whole group at a step boundary with a
    checkpoint (both exit 0), and the restarted group finishes the stream: every batch once, parameters
    identical after every step. 85 batches: odd, so a replica joins a step with nothing. Under FSDP2 the
    weights are sharded and the digests are of the gathered full weights: the same rounds, the same proof."""
    job = write_job(assets, drafters=drafter(2, distributed=distributed), name="rep2")
    run = job.parent
    ckpts = run / "checkpoints" / "d0"
    plog = tmp_path / "p.log"
    logs = [[tmp_path / f"c{r}-{k}.log" for r in range(2)] for k in range(2)]
    traces = [[tmp_path / f"t{r}-{k}.jsonl" for r in range(2)] for k in range(2)]
    prod = producer(job, plog)
    port = free_port()
    first = [consumer(job, logs[0][r], traces[0][r], port, replica=r, replicas=2) for r in range(2)]
    try:
        deadline = time.monotonic() + 180
        while (ck := load_latest(ckpts)) is None or ck.step < 10:
            assert time.monotonic() < deadline and all(p.poll() is None for p in first), tail(plog, *logs[0])
            time.sleep(0.1)
        first[1].send_signal(signal.SIGTERM)  # one replica only: the group stops together
        assert wait_all(first, timeout=60) == [0, 0], tail(*logs[0])
        stopped = load_latest(ckpts)
        port = free_port()
        second = [consumer(job, logs[1][r], traces[1][r], port, replica=r, replicas=2) for r in range(2)]
        assert wait_all([*second, prod]) == [0, 0, 0], tail(plog, *logs[1])
    finally:
        for p in [prod, *first]:
            p.kill()
    total = planned(plog)
    assert total % 2 == 1
    before, after = ([read_trace(t) for t in traces[k]] for k in range(2))
    assert_identical_replicas(before)
    assert_identical_replicas(after)
    assert len(before[0]) == stopped.step and after[0][0]["step"] == stopped.step + 1  # no step lost
    assert seqs_of(*before, *after) == list(range(total))  # the producer's whole stream, no batch twice
    samples = sorted(s for t in before + after for row in t for s in row["samples"])
    assert samples == list(range(SAMPLES))
    assert any(not row["seqs"] for t in after for row in t)  # a replica joined a step idle (odd count)
    final = load_latest(ckpts)
    assert final.step == len(after[0]) + stopped.step and final.state["group"]["cursors"] == [total]
    assert final.state["last_seq"] == total - 1
    c0, c1 = logs[1][0].read_text(), logs[1][1].read_text()
    assert "checkpoint at step" in c0 and "checkpoint at step" not in c1  # rank 0 alone writes
    assert "allreduce_wait" in c0 and "allreduce_wait" in c1  # the wait at the all-reduce is profiled
    assert ("FSDP2 over 2 replicas" in c0) == (distributed == "fsdp")


def test_two_nodes_train_disjoint_covering_shards_with_identical_parameters(assets, tmp_path):
    """Two producers (node 0 and node 1, each its own run directory and shard), one consumer each, one
    process group over 127.0.0.1. 768 tokens per batch: shards of 28 and 27 batches (uneven ends)."""
    jobs = [write_job(assets, drafters=drafter(1), tokens_per_batch=768, name=f"node{n}") for n in range(2)]
    port = free_port()
    plogs, clogs = [tmp_path / f"p{n}.log" for n in range(2)], [tmp_path / f"c{n}.log" for n in range(2)]
    traces = [tmp_path / f"t{n}.jsonl" for n in range(2)]
    procs = [producer(jobs[n], plogs[n], node=n, nnodes=2) for n in range(2)]
    procs += [consumer(jobs[n], clogs[n], traces[n], port, replica=0, replicas=1, node=n, nnodes=2) for n in range(2)]
    assert wait_all(procs) == [0, 0, 0, 0], tail(*plogs, *clogs)
    tr = [read_trace(t) for t in traces]
    totals = [planned(p) for p in plogs]
    assert totals == [28, 27]
    assert_identical_replicas(tr)
    for n in range(2):
        assert seqs_of(tr[n]) == list(range(totals[n]))  # each node's own stream, exactly once
        assert all(row["node"] == n for row in tr[n])
    shard0, shard1 = ({s for row in t for s in row["samples"]} for t in tr)
    assert not shard0 & shard1 and shard0 | shard1 == set(range(SAMPLES))
    ckpt = load_latest(jobs[0].parent / "checkpoints" / "d0")
    assert ckpt.state["group"]["cursors"] == totals and ckpt.step == len(tr[0])
    assert not (jobs[1].parent / "checkpoints").exists()  # global rank 0 alone writes


def test_a_killed_replica_fails_the_group_cleanly_and_the_restart_resumes_from_the_checkpoint(assets, tmp_path):
    job = write_job(assets, drafters=drafter(2, checkpoint_every=5), name="kill")
    run, port = job.parent, free_port()
    ckpts = run / "checkpoints" / "d0"
    plog = tmp_path / "p.log"
    logs = [[tmp_path / f"c{r}-{k}.log" for r in range(2)] for k in range(2)]
    traces = [[tmp_path / f"t{r}-{k}.jsonl" for r in range(2)] for k in range(2)]
    prod = producer(job, plog)
    first = [consumer(job, logs[0][r], traces[0][r], port, replica=r, replicas=2) for r in range(2)]
    try:
        deadline = time.monotonic() + 180
        while (ck := load_latest(ckpts)) is None or ck.step < 10:
            assert time.monotonic() < deadline and all(p.poll() is None for p in first), tail(plog, *logs[0])
            time.sleep(0.1)
        first[1].send_signal(signal.SIGKILL)
        assert wait_all(first, timeout=60)[0] == 5, tail(*logs[0])  # EXIT_GROUP_LOST, no hang
        log0 = logs[0][0].read_text()
        assert "the group failed during" in log0 and "is intact" in log0
        kept = load_latest(ckpts)  # readable, and the one the survivor did not overwrite
        assert kept.step >= 10 and kept.step % 5 == 0
        deadline = time.monotonic() + 60
        while "fenced d0.r1" not in plog.read_text():  # the producer let the dead member go: the group re-forms
            assert time.monotonic() < deadline and prod.poll() is None, tail(plog)
            time.sleep(0.1)
        port = free_port()
        second = [consumer(job, logs[1][r], traces[1][r], port, replica=r, replicas=2) for r in range(2)]
        assert wait_all([*second, prod]) == [0, 0, 0], tail(plog, *logs[1])
    finally:
        for p in [prod, *first]:
            p.kill()
    assert all(f"resumed from {kept.path}" in p.read_text() for p in logs[1])
    before = [[row for row in read_trace(t) if row["step"] <= kept.step] for t in traces[0]]
    after = [read_trace(t) for t in traces[1]]
    assert_identical_replicas(before)
    assert_identical_replicas(after)
    assert before[0][-1]["step"] == kept.step and after[0][0]["step"] == kept.step + 1
    assert seqs_of(*before, *after) == list(range(planned(plog)))  # nothing trained twice or skipped
