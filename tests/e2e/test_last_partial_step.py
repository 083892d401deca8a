"""The plan's last, partial accumulation step is trained (issue 36 §1), with the real processes, over 13 batches
(odd): one producer feeding one replica and a DDP group of two (tokens_per_step = 2 batches) and an FSDP group
of two (the whole plan one partial step); two producers feeding one replica (fan-in, 2 batches a step). Every
batch is trained and the audit says "complete" for each; each group's checkpoint, resumed by one replica, says
in one line that the world changed and what was re-sharded."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.harness import ROOT, free_port, spawn
from common.config import load_job
from consumer.build import load_training
from consumer.distributed import GroupEnv, ReplicaGroup
from tests.jobs import tiny_assets, wait_all, write_job

TOKENS_PER_BATCH = 3072  # 13 batches of 1885..3072 tokens over tiny_assets' 240 chats
BATCHES = 13
pytestmark = pytest.mark.slow


def drafter(name: str, replicas: int, distributed: str = "ddp", tokens_per_step: int = TOKENS_PER_BATCH + 1) -> dict:
    """tokens_per_step: by default any two batches reach it and no one batch does: 2 batches a step."""
    return {
        "name": name,
        "replicas": replicas,
        "distributed": distributed,
        "tokens_per_step": tokens_per_step,
        "block_size": 4,
        "num_layers": 1,
        "anchors_per_seq": 8,
        "loss_chunk_rows": 64,
        "checkpoint_every": 1000,
        "log_every": 1,
        "total_steps": 7,
    }


def consumer(job: Path, log: Path, name: str, replica: int, replicas: int, port: int) -> subprocess.Popen:
    group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(replicas), "RANK": str(replica)}
    return spawn(
        ["-m", "consumer", "--job", job, "--drafter", name, "--replica", replica, "--dist-timeout", "60"],
        log,
        {**group, "LOCAL_RANK": str(replica)},
    )


def step_seqs(run: Path, name: str) -> list[list[int]]:
    """The seqs of each optimizer step of drafter `name`, its replicas' step records merged, in step order."""
    steps: dict[int, list[int]] = {}
    for path in (run / "accounting").glob(f"consumer-{name}-r*.jsonl"):
        for rec in map(json.loads, path.read_text().splitlines()):
            if rec["kind"] == "step":
                steps.setdefault(rec["step"], []).extend(rec["seqs"])
    return [sorted(steps[s]) for s in sorted(steps)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


def audit_complete(run: Path, drafters: list[str]) -> None:
    check = subprocess.run(
        [sys.executable, "-m", "common.accounting_check", str(run)], cwd=ROOT, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    lines = check.stdout.splitlines()
    for name in drafters:
        line = next(li for li in lines if li.startswith(f"{name}: "))
        assert line.startswith(f"{name}: ok: {BATCHES} batches") and line.endswith("; complete"), check.stdout


def test_an_odd_plan_with_two_batch_steps_trains_every_batch_in_every_topology(assets, tmp_path, caplog):
    job = write_job(
        assets,
        # FSDP: the whole plan short of one step, so its one step is the partial last one whatever the arrival
        drafters=[drafter("one", 1), drafter("ddp", 2), drafter("fsdp", 2, "fsdp", tokens_per_step=10**9)],
        tokens_per_batch=TOKENS_PER_BATCH,
        name="tail",
    )
    run = job.parent
    logs = {k: tmp_path / f"{k}.log" for k in ("producer", "one", "ddp0", "ddp1", "fsdp0", "fsdp1")}
    procs = [spawn(["-m", "producer", "--job", job], logs["producer"]), consumer(job, logs["one"], "one", 0, 1, 0)]
    for name in ("ddp", "fsdp"):
        port = free_port()
        procs += [consumer(job, logs[f"{name}{r}"], name, r, 2, port) for r in range(2)]
    statuses = wait_all(procs, timeout=300)
    said = {k: p.read_text() if p.exists() else "" for k, p in logs.items()}
    assert statuses == [0] * 6, "\n".join(f"== {k}\n{v[-2500:]}" for k, v in said.items())
    assert f"{BATCHES} batches planned" in said["producer"]

    one = step_seqs(run, "one")  # 2 batches a step, the 13th alone in the last one
    assert one == [[s, s + 1] for s in range(0, BATCHES - 1, 2)] + [[BATCHES - 1]]
    assert "one_r0: the plan's last" in said["one"] and "make a partial last step" in said["one"]
    assert f"end of stream (data exhausted); trained through seq {BATCHES - 1}" in said["one"]
    assert sorted(s for step in step_seqs(run, "ddp") for s in step) == list(range(BATCHES))
    assert step_seqs(run, "fsdp") == [list(range(BATCHES))]  # before: no step at all, nothing saved
    assert "fsdp_r0: the plan's last" in said["fsdp0"] and "make a partial last step" in said["fsdp0"]
    audit_complete(run, ["one", "ddp", "fsdp"])

    # each group's checkpoint resumed by one replica: the world change is said, in one line on the writer
    single = GroupEnv.resolve({}, replica=0, replicas=1, node_rank=0, nnodes=1)
    jobcfg = load_job(job)
    for name, what in (
        ("ddp", "weights and optimizer state loaded whole on each of the 1 replica(s)"),
        ("fsdp", "the writer's anchor RNG on every replica (the 2 per-replica streams fit 2)"),
    ):
        cfg = jobcfg.drafter(name).model_copy(update={"replicas": 1})
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="consumer"):
            load_training(
                jobcfg, cfg, single, ReplicaGroup(single, torch.device("cpu")), torch.device("cpu"), None, name
            )
        changed = [r.getMessage() for r in caplog.records if "was written by a group of" in r.getMessage()]
        assert len(changed) == 1 and "was written by a group of 2 replica(s), this run has 1: " in changed[0], changed
        assert what in changed[0], changed[0]


def test_two_producers_feeding_one_replica_train_the_last_partial_step(assets, tmp_path):
    """Fan-in (target.replicas = 2): the stream ends when both producers said the plan is delivered."""
    job = write_job(
        assets,
        drafters=[drafter("one", 1)],
        tokens_per_batch=TOKENS_PER_BATCH,
        overrides={"target": {"replicas": 2}},
        name="tailfan",
    )
    logs = [tmp_path / f"{k}.log" for k in ("p0", "p1", "one")]
    procs = [spawn(["-m", "producer", "--job", job, "--replica", p], logs[p]) for p in range(2)]
    procs.append(consumer(job, logs[2], "one", 0, 1, 0))
    statuses = wait_all(procs, timeout=300)
    assert statuses == [0] * 3, "\n".join(f"== {p}\n{p.read_text()[-2500:]}" for p in logs if p.exists())
    steps = step_seqs(job.parent, "one")  # the order is the producers' race; the sizes are not
    assert [len(s) for s in steps] == [2] * (BATCHES // 2) + [1]
    assert sorted(s for step in steps for s in step) == list(range(BATCHES))
    audit_complete(job.parent, ["one"])
