"""A changed plan is never trained in silence, a changed drafter shape gets one clear line (issue 24 items 1-3),
through launch.sh and the real processes, one run folder rerun in sequence:

  1. 3 epochs, trained to the end;
  2. the data file appended, same command: refused before anything trains (producer exit 2 naming the data,
     launch.sh tears the group down); before the fix this exited 0 and trained the new plan from the old cursor;
  3. the original data and epochs 3 → 5: the two epochs are appended and the audit says the plan grew (before:
     exit 1 "different plans");
  4. the appended data under data.lineage = "2": the new plan trains from the current weights from seq 0, and the
     audit checks both lineages;
  5. block_size 8 → 16: the consumer exits 2 with one line naming the key and both values (before: a traceback).
A shuffled data file and num_layers 1 → 2 are the same code paths, checked without processes in
tests/producer/test_plan_fingerprint.py and tests/consumer/test_checkpoint_fallback.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.accounting_check import check_run
from demo.tiny import synthetic_chats
from tests.jobs import ROOT, finish, launch, tiny_assets, write_job

pytestmark = pytest.mark.slow
DRAFTER = [
    {
        "name": "d0",
        "block_size": 8,
        "num_layers": 1,
        "anchors_per_seq": 8,
        "loss_chunk_rows": 64,
        "checkpoint_every": 2,
        "log_every": 1,
    },
]


def job_file(template: str, run: Path, *, epochs: int, lineage: str | None = None, block_size: int = 8) -> Path:
    """The job with another epochs / lineage / block_size (the same run folder; the producer copies the job
    it runs to RUN_DIR/job.toml, so every variant is its own file)."""
    text = template.replace("epochs = 3", f"epochs = {epochs}").replace("block_size = 8", f"block_size = {block_size}")
    if lineage is not None:
        text = text.replace("[transport]", f'lineage = "{lineage}"\n[transport]')
    out = run / f"job-e{epochs}-{lineage}-b{block_size}.toml"
    out.write_text(text)
    return out


def accounting_check(run: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "common.accounting_check", str(run)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args, "--profile-interval", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )


def deliveries(run: Path) -> int:
    return sum(f.read_text().count('"kind":"batch"') for f in (run / "accounting").glob("producer-*.jsonl"))


def test_changed_data_is_refused_epochs_grow_a_new_lineage_trains_and_a_shape_change_names_the_key(tmp_path_factory):
    assets = tiny_assets(tmp_path_factory.mktemp("assets"))
    base = write_job(assets, drafters=DRAFTER, tokens_per_batch=2048, epochs=3, name="plan")
    run = base.parent
    data = run / "data.jsonl"
    lines = [json.dumps(r) for r in synthetic_chats(12, seed=5)]
    extra = [json.dumps(r) for r in synthetic_chats(4, seed=6)]
    data.write_text("\n".join(lines) + "\n")
    template = base.read_text().replace(str(assets / "train.jsonl"), str(data))
    job3 = job_file(template, run, epochs=3)

    first = launch(job3, "--grace", "60")
    assert (out := finish(first, 300)) and first.returncode == 0, out
    trained = deliveries(run)

    data.write_text("\n".join(lines + extra) + "\n")  # appended
    appended = launch(job3, "--grace", "60")
    out = finish(appended, 300)
    assert appended.returncode == 2, out
    refusal = [li for li in (run / "logs" / "producer.log").read_text().splitlines() if "ERROR" in li]
    assert len(refusal) == 1, refusal
    assert "the data file's content (data.path)" in refusal[0] and "the data file's size (data.path)" in refusal[0]
    assert f"data file {data}" in refusal[0] and 'data.lineage = "2"' in refusal[0] and "job.run_dir" in refusal[0]
    assert "launch.sh: producer exited with status 2" in out and "Traceback" not in out
    assert deliveries(run) == trained  # refused before anything was delivered

    data.write_text("\n".join(lines) + "\n")  # restored: the same plan, two epochs more
    more = launch(job_file(template, run, epochs=5), "--grace", "60")
    assert (out := finish(more, 300)) and more.returncode == 0, out
    assert "epochs raised 3 → 5; the trained epochs stay, 2 appended" in (run / "logs" / "producer.log").read_text()
    check = accounting_check(run)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "5 whole epochs verified" in check.stdout and "; complete" in check.stdout, check.stdout
    assert "plan grew by epochs 3 → 5" in check.stdout, check.stdout
    d0 = check_run(run).drafters["d0"]
    assert [(p.lineage, p.epochs_complete, p.complete) for p in d0.lineages] == [("main", 5, True)]
    main_batches = d0.trained_batches

    data.write_text("\n".join(lines + extra) + "\n")  # the appended data again, as a new lineage
    job2 = job_file(template, run, epochs=3, lineage="2")
    lineage2 = launch(job2, "--grace", "60")
    assert (out := finish(lineage2, 300)) and lineage2.returncode == 0, out
    assert "data lineage '2' starts a new plan of 3 epoch(s)" in (run / "logs" / "producer.log").read_text()
    consumer_log = (run / "logs" / "consumer-d0-r0.log").read_text()
    assert "into data lineage '2' (after 'main'): a new plan from seq 0" in consumer_log
    check = accounting_check(run)
    assert check.returncode == 0, check.stdout + check.stderr
    report = check_run(run)
    d0 = report.drafters["d0"]
    assert report.ok and d0.complete and d0.duplicate_batches == 0 and d0.missing_batches == 0
    assert [(p.lineage, p.epochs_complete, p.complete) for p in d0.lineages] == [("main", 5, True), ("2", 3, True)]
    assert d0.lineages[0].trained_batches == main_batches and d0.lineages[1].trained_batches > 0
    assert "lineage 'main': " in check.stdout and "lineage '2': " in check.stdout, check.stdout

    done = run_module(
        "consumer", "--job", str(job_file(template, run, epochs=3, lineage="2", block_size=16)), "--drafter", "d0"
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [li for li in done.stderr.splitlines() if " ERROR " in li]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "was trained with block_size = 8, this job has block_size = 16 (drafters.block_size)" in errors[0], errors
