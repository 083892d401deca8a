"""The one-machine layout planned from the job file alone: the worked example (Qwen3.6-27B on 8 GPUs) and every
other example (gpt-oss-120b with expert parallelism) pass launch.sh --dry-run without a GPU and the device map says
which process runs where, which expert slice each rank holds and who feeds whom; the telemetry's W&B run is the
node, in the group named after the job."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_job
from common.launch_plan import device_map, plan
from telemetry.service import TelemetryService
from tests.jobs import tiny_assets, write_job

ROOT = Path(__file__).resolve().parents[2]
# the ports below are the default base (29500): the plan's processes must not see a MASTER_PORT of the caller's
# (tests/conftest.py sets one per xdist worker)
DEFAULT_PORTS = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
EXAMPLE = ROOT / "deploy" / "examples" / "qwen36-27b-8gpu.toml"
MOE_EXAMPLE = ROOT / "deploy" / "examples" / "gpt-oss-120b-8gpu.toml"


def test_worked_example_passes_dry_run_and_maps_every_gpu():
    env = {**DEFAULT_PORTS, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}  # nothing needs a GPU to plan
    res = subprocess.run(
        [str(ROOT / "launch.sh"), str(EXAMPLE), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {
        li.split()[0]: li.split()[1]
        for li in res.stdout.splitlines()
        if li.startswith("  ") and li.split()[0].startswith(("producer", "consumer"))
    }
    assert rows == {
        "producer": "cuda:0",
        "producer-tp1": "cuda:1",
        "producer-p1": "cuda:2",
        "producer-p1-tp1": "cuda:3",
        "consumer-b16-r0": "cuda:4",
        "consumer-b16-r1": "cuda:5",
        "consumer-b8-r0": "cuda:6",
        "consumer-b8-r1": "cuda:7",
    }
    assert res.stdout.count("fed by producer, producer-p1") == 4
    assert 'W&B run "node0" in group "qwen36-27b-8gpu"' in res.stdout
    assert res.stdout.count("-m telemetry") == 1  # ONE telemetry process for the machine
    assert "TP group on port 29502" in res.stdout and "TP group on port 29503" in res.stdout
    # the TP ranks' variables: LOCAL_RANK is the CUDA index transformers binds
    assert "RANK=1 LOCAL_RANK=3 LOCAL_WORLD_SIZE=2 " in res.stdout and "--replica 1" in res.stdout


def test_example_settings_are_the_published_ones():
    job = load_job(EXAMPLE)
    assert (job.target.tp_size, job.target.replicas) == (2, 2)
    assert [job.target.devices_of(r) for r in range(2)] == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    assert job.target.layer_ids == [1, 16, 31, 46, 61] and job.transport_kind == "cuda"
    assert [(d.block_size, d.replicas, d.devices) for d in job.drafters] == [
        (16, 2, ["cuda:4", "cuda:5"]),
        (8, 2, ["cuda:6", "cuda:7"]),
    ]
    names = [p.name for p in plan(job, str(EXAMPLE), "py")]
    assert len(names) == 9 and names.count("telemetry") == 1


@pytest.mark.parametrize("example", sorted((ROOT / "deploy" / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_every_example_passes_dry_run(example):
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(
        [str(ROOT / "launch.sh"), str(example), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"device map of job {load_job(example).job.name}, node 0 of 1:" in res.stdout


def test_moe_example_shards_the_experts_across_its_tp_group():
    """gpt-oss-120b: one target replica at TP 4 = EP 4 on cuda:0-3 (32 of the 128 experts whole per rank), four
    drafter replicas on cuda:4-7; the device map says which expert slice each rank holds."""
    job = load_job(MOE_EXAMPLE)
    assert (job.target.tp_size, job.target.ep_size, job.target.replicas) == (4, 4, 1)
    text = device_map(job)
    rows = {li.split()[0]: li.split(None, 2)[1:] for li in text.splitlines() if li.startswith("  ")}
    for k in range(4):
        dev, what = rows["producer" + (f"-tp{k}" if k else "")]
        assert dev == f"cuda:{k}" and f"TP rank {k} of 4, EP rank {k} (expert slice {k}: 1/4" in what
    assert [rows[f"consumer-b16-r{r}"][0] for r in range(4)] == ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]
    assert "target: 1 replica(s) × TP 4 (EP 4: each rank holds 1/4 of the experts whole) = 4 rank(s)" in text
    assert "EP" not in device_map(load_job(EXAMPLE))  # a dense target's map says nothing about experts


def test_device_map_of_a_second_node_names_its_run(tmp_path):
    text = device_map(load_job(EXAMPLE), node_rank=1, nnodes=2)
    assert text.startswith("device map of job qwen36-27b-8gpu, node 1 of 2:")
    assert 'W&B run "node1" in group "qwen36-27b-8gpu"' in text


def test_wandb_run_is_the_node_in_the_jobs_group(tmp_path):
    assets = tiny_assets(tmp_path / "assets")
    job = load_job(write_job(assets, name="wbname"))
    runs = {}
    for node in (0, 1):
        service = TelemetryService(job, logging.getLogger("test"), node=node)
        try:
            runs[node] = service.wandb._init_args
        finally:
            service.close()
    assert runs[0]["group"] == runs[1]["group"] == job.job.name
    assert (runs[0]["name"], runs[1]["name"]) == ("node0", "node1")
    assert runs[0]["id"] != runs[1]["id"]  # nodes whose run folders share a path do not share a run


def test_stats_show_each_producer_and_the_balance_between_them():
    from common.profile import ProfileStats
    from telemetry.aggregate import Aggregator
    from telemetry.cli import summary, view
    from tests.telemetry.test_telemetry_unit import payload

    agg = Aggregator(stale_after_s=10.0)
    for pid, (name, tokens) in enumerate([("producer", 400), ("producer-p1", 300)]):
        prof = ProfileStats()
        prof.count("tokens", tokens)
        agg.ingest(payload(prof, seq=0, mono=2.0, role="producer", name=name, pid=pid), now=2.0)
    metrics, summaries = agg.close_window(now=2.0)
    assert sorted(s["name"] for s in summaries) == ["producer", "producer-p1"]  # one row each
    assert metrics["pipeline/tokens_per_s"] == 350.0 and metrics["pipeline/producer_balance"] == 0.75
    state = view({"job": "j", "metrics": metrics, "sources": [], "gpus": [], "ring": {}, "health": {}})
    assert state["pipeline"] == {"tokens_per_s": 350.0, "producers_reporting": 2.0, "producer_balance": 0.75}
    assert "350 tok/s from 2 producers, balance 0.75 |" in summary(state)


def test_systemd_units_express_the_same_layout(tmp_path):
    """`--env-files` writes each process's group variables where the units read them; the producer template's
    instance "<replica>-<rank>" starts that replica's producer with that rank's variables."""
    res = subprocess.run(
        [sys.executable, "-m", "common.launch_plan", str(EXAMPLE), "--env-files", str(tmp_path)],
        cwd=ROOT,
        env=DEFAULT_PORTS,
        capture_output=True,
        text=True,
        check=True,
    )
    units = res.stdout.split()
    assert units.count("dflash-telemetry.service") == 1 and "dflash-producer.service" not in units
    assert [u for u in units if u.startswith("dflash-producer@")] == [
        "dflash-producer@0-0.service",
        "dflash-producer@0-1.service",
        "dflash-producer@1-0.service",
        "dflash-producer@1-1.service",
    ]
    env = dict(li.split("=", 1) for li in (tmp_path / "producer-1-1.env").read_text().split())
    assert env == {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29503",
        "WORLD_SIZE": "2",
        "RANK": "1",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "2",
    }
    assert "RANK=1\n" in (tmp_path / "consumer-b8-1.env").read_text()
    unit = (ROOT / "deploy" / "systemd" / "dflash-producer@.service").read_text()
    script = next(li for li in unit.splitlines() if li.startswith("ExecStart=")).split("'")[1]
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    out = subprocess.run(
        ["/bin/sh", "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={"DFLASH_PYTHON": str(fake), "DFLASH_JOB": "/etc/dflash/job.toml", "DFLASH_INSTANCE": "1-0"},
    ).stdout
    assert out.split() == [
        "-m",
        "producer",
        "--job",
        "/etc/dflash/job.toml",
        "--replica",
        "1",
        "--node-rank",
        "0",
        "--nnodes",
        "1",
    ]
    assert "EnvironmentFile=/etc/dflash/producer-%i.env" in unit and "PartOf=dflash.target" in unit


def test_a_target_replica_makes_every_rth_seq_and_resumes_at_its_own_next_one():
    from producer.delivery import Delivery

    d = Delivery(["a", "b"], total_batches=9, stride=2, offset=1)  # replica 1 of 2: seqs 1, 3, 5, 7
    for peer, drafter, resume in ((b"a", "a", 0), (b"b", "b", 4)):
        d.join(peer, drafter, 0, 1, resume)
        d.attach(peer, d.by_peer[peer].epoch)
    assert (d.groups["a"].cursor, d.groups["b"].cursor) == (1, 5)  # the first of its seqs at or after the resume
    made = []
    while (seq := d.next_seq()) is not None:
        made.append((seq, sorted(m.drafter for m in d.recipients(seq))))
    assert made == [(1, ["a"]), (3, ["a"]), (5, ["a", "b"]), (7, ["a", "b"])]
    assert d.finished()
