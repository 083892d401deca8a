"""Two simulated machines, each with two target replicas, one drafter group across both (launch.sh with
--nnodes 2 --node-rank n, one run folder per node, loopback rendezvous): every sample of the data is trained
exactly once over the four producers, and node 0's audit (with node 1's logs) proves it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import free_port
from consumer.checkpoint import load_latest
from tests.jobs import ROOT, finish, launch, tiny_assets, write_job

DRAFTER = [
    {
        "name": "a",
        "block_size": 8,
        "num_layers": 1,
        "anchors_per_seq": 16,
        "loss_chunk_rows": 64,
        "checkpoint_every": 4,
        "log_every": 1,
    },
]
pytestmark = pytest.mark.slow


def test_two_nodes_of_two_producers_train_every_sample_once(tmp_path_factory):
    assets = tiny_assets(tmp_path_factory.mktemp("assets"))
    jobs = []
    for n in range(2):
        job = write_job(assets, drafters=DRAFTER, tokens_per_batch=768, name=f"mn{n}")
        job.write_text(job.read_text().replace("num_features = 3", "num_features = 3\nreplicas = 2"))
        jobs.append(job)
    port = str(free_port())
    procs = [
        launch(
            job,
            "--nnodes",
            "2",
            "--node-rank",
            str(n),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "--grace",
            "60",
        )
        for n, job in enumerate(jobs)
    ]
    outs = [finish(p, 600) for p in procs]
    for n, out in enumerate(outs):
        assert procs[n].returncode == 0, out
        assert "started producer-p1 " in out and "started producer " in out, out
    run0, run1 = (job.parent for job in jobs)
    check = subprocess.run(
        [sys.executable, "-m", "common.accounting_check", str(run0), "--logs-from", str(run1), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    audit = json.loads(check.stdout)["drafters"]["a"]
    planned = [_count(run, "producer", "batches planned") for run in (run0, run1)]
    made = [_count(run, name, "producer done") for run in (run0, run1) for name in ("producer", "producer-p1")]
    assert all(m > 0 for m in made), made  # all four producers fed the group
    assert sum(made) == sum(planned) == audit["trained_batches"]  # 28 + 27 batches at 768 tokens
    assert audit["complete"] and audit["duplicate_batches"] == audit["missing_batches"] == 0
    assert audit["lost_samples"] == audit["duplicate_samples"] == 0
    group = load_latest(run0 / "checkpoints" / "a").state["group"]
    assert group["producers"] == 2 and len(group["cursors"]) == 4  # one cursor per (node, producer)
    assert not (run1 / "checkpoints").exists()  # global rank 0 alone writes


def _count(run: Path, log: str, marker: str) -> int:
    """N of the log's "...; N batches planned" or "producer done (...): N batches" line."""
    line = next(li for li in (run / "logs" / f"{log}.log").read_text().splitlines() if marker in li)
    words = line.split()
    return int(words[-3]) if marker == "batches planned" else int(line.split("): ")[1].split()[0])
