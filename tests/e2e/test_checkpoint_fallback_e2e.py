"""A corrupted latest checkpoint between two runs of the real processes (issue 14 item 7): the restarted
consumer names the broken file, resumes from the previous intact checkpoint, removes what killed writes left
(saying so), finishes the stream, and the exactly-once checker passes on the lineage it really followed."""

from __future__ import annotations

import signal
import time

import pytest

from bench.harness import spawn
from common.accounting_check import check_run
from consumer.checkpoint import STATE_FILE, load_latest
from tests.jobs import tiny_assets, wait_all, write_job

pytestmark = pytest.mark.slow
DRAFTER = [
    {
        "name": "d0",
        "block_size": 8,
        "num_layers": 1,
        "anchors_per_seq": 16,
        "loss_chunk_rows": 64,
        "checkpoint_every": 10,
        "log_every": 5,
        "total_steps": 200,
    },
]


def test_a_truncated_latest_checkpoint_resumes_from_the_previous_and_stays_exactly_once(tmp_path_factory, tmp_path):
    job = write_job(tiny_assets(tmp_path_factory.mktemp("assets")), drafters=DRAFTER, name="fallback")
    run, ckpts = job.parent, job.parent / "checkpoints" / "d0"
    plog, c1, c2 = tmp_path / "p.log", tmp_path / "c1.log", tmp_path / "c2.log"
    prod = spawn(["-m", "producer", "--job", job], plog)
    cons = spawn(["-m", "consumer", "--job", job, "--drafter", "d0"], c1)
    try:
        deadline = time.monotonic() + 180
        while (ck := load_latest(ckpts)) is None or ck.step < 20:
            assert time.monotonic() < deadline and cons.poll() is None, c1.read_text()[-2000:]
            time.sleep(0.2)
        cons.send_signal(signal.SIGTERM)
        assert wait_all([cons]) == [0], c1.read_text()[-2000:]
        broken = load_latest(ckpts).path
        intact = sorted((p for p in ckpts.glob("step_*") if p != broken), key=lambda p: int(p.name[5:]))[-1]
        state = broken / STATE_FILE
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 3])  # a torn write
        (ckpts / ".step_999.k1ll3d00").mkdir()  # what a kill inside a write leaves (issue 36 §3)
        (ckpts / ".step_999.k1ll3d00" / STATE_FILE).write_bytes(b"\0" * 4096)
        (ckpts / ".write-probe-0a1b2c3d").write_bytes(b"x")
        cons2 = spawn(["-m", "consumer", "--job", job, "--drafter", "d0"], c2)
        assert wait_all([cons2, prod]) == [0, 0], c2.read_text()[-3000:] + plog.read_text()[-2000:]
    finally:
        for p in (prod, cons):
            p.kill()
    log = c2.read_text()
    assert f"checkpoint {broken} is not used: {state} has" in log and "Traceback" not in log
    assert f"resuming from the previous intact checkpoint {intact}" in log
    assert f"resumed from {intact}" in log and (ckpts / f"corrupt-{broken.name}").is_dir()
    assert f"removed 2 leftover(s) of interrupted checkpoint writes from {ckpts} (0.0 MiB freed): " in log
    assert not [p.name for p in ckpts.iterdir() if p.name.startswith(".")]
    planned = next(li for li in plog.read_text().splitlines() if "batches planned" in li)
    total = int(planned.split()[-3])  # "...; N batches planned"
    final = load_latest(ckpts)
    assert final.state["last_seq"] == total - 1 and final.step == total  # one batch per step, each once
    report = check_run(run)
    d0 = report.drafters["d0"]
    assert report.ok and d0.complete, (report.errors, d0.errors)
    assert d0.duplicate_batches == 0 and d0.missing_batches == 0 and d0.trained_batches == total
