"""A run folder whose disk fills to zero (issue 36 §4): the failing process's log cannot be written, yet its last
error reaches launch.sh's terminal, with the full disk named (common/log_tee.py keeps the tail off that disk).
The process is a stand-in (DFLASH_LAUNCH_PLAN_FILE) that fails the way a consumer does: a Python write that
raises ENOSPC, uncaught. The disk is a real 2 MiB tmpfs (root only; skipped otherwise)."""

from __future__ import annotations

import errno
import os
import sys
import time

import pytest

from bench.harness import write_job
from bench.soak_faults import fill
from common.log_tee import Tee
from tests.jobs import finish, launch

STANDIN = """import sys, time
from pathlib import Path
run, go = Path(sys.argv[1]), Path(sys.argv[2])
print("consumer-d0-r0 INFO step 10: loss 2.000", flush=True)
while not go.exists():
    time.sleep(0.05)
print("consumer-d0-r0 INFO saving checkpoint step_20", flush=True)
(run / "checkpoints").mkdir(exist_ok=True)
(run / "checkpoints" / "big").write_bytes(b"x" * (4 << 20))
"""


@pytest.fixture
def small_disk(tmpfs):
    return tmpfs(2048)


def test_the_failing_process_s_error_and_the_full_disk_reach_the_terminal(small_disk, tmp_path):
    run_dir = small_disk / "run"
    job = tmp_path / "job.toml"
    write_job(
        job,
        {
            "job": {"name": f"full-{tmp_path.name[-8:]}", "run_dir": str(run_dir)},
            "target": {"path": "unused"},
            "data": {"path": "unused"},
            "drafters": [{"name": "d0"}],
        },
    )
    standin, go = tmp_path / "standin.py", tmp_path / "go"
    standin.write_text(STANDIN)
    logs = run_dir / "logs"
    plan = tmp_path / "plan.tsv"
    plan.write_text(
        f"telemetry\t0\t{logs}/telemetry.log\tsleep 600\n"
        f"consumer-d0-r0\t1\t{logs}/consumer-d0-r0.log\t{sys.executable} {standin} {run_dir} {go}\n"
    )
    proc = launch(job, "--grace", "20", plan=plan)
    try:
        log = logs / "consumer-d0-r0.log"
        deadline = time.monotonic() + 60
        while not (log.is_file() and "step 10" in log.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "the stand-in did not start"
            time.sleep(0.05)
        fill(small_disk, leave_bytes=0)
        _pad(log)  # its last block full too: not one more byte goes into the log
        go.touch()
        out = finish(proc, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    assert "step_20" not in log.read_text() and "Errno 28" not in log.read_text()  # it took none of its last lines
    assert f"consumer-d0-r0 exited with status 1 (log {log}); tearing the job down" in out
    assert '    (run / "checkpoints" / "big").write_bytes(' in out  # the traceback's last lines
    assert "    OSError: [Errno 28] No space left on device" in out
    assert f"of its output could not be written to {log}: No space left on device)" in out
    assert f"launch.sh: consumer-d0-r0 failed on a full disk: {run_dir} is on {small_disk}, 0 MiB free now." in out
    assert "it resumes from the last intact checkpoint" in out


def test_the_tee_writes_what_it_lost_once_it_can_and_keeps_a_bounded_tail(tmp_path, monkeypatch):
    log, tail = tmp_path / "p.log", tmp_path / "p.tail"
    tee = Tee(str(log), str(tail))
    tee.feed(b"one\ntwo\n")
    with monkeypatch.context() as full:  # the disk is full for this read
        full.setattr("common.log_tee.os.write", _enospc)
        tee.feed(b"three\nfour\n")
    assert log.read_text() == "one\ntwo\n"
    assert (tmp_path / "p.tail.lost").read_text() == (
        f"2 line(s) (11 bytes) of its output could not be written to {log}: No space left on device\n"
    )
    tee.feed(b"five\n" + b"x" * 5000 + b"\n")
    assert log.read_text().splitlines()[2:4] == [
        "[log_tee] 2 line(s) of this output could not be written here (No space left on device)",
        "five",
    ]
    assert tail.read_text().splitlines()[:5] == ["one", "two", "three", "four", "five"]
    assert len(tail.read_text().splitlines()[5]) == 2000  # one line's end, not all of it
    for n in range(30):
        tee.feed(f"line {n}\n".encode())
    tee.feed(b"no newline yet")
    tee.end()
    lines = tail.read_text().splitlines()
    assert lines[-2:] == ["line 29", "no newline yet"] and len(lines) == 20


def _pad(path) -> None:
    """Append to `path` until its disk refuses a byte."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        while os.write(fd, b"." * 512):
            pass
    except OSError as err:
        assert err.errno == errno.ENOSPC
    finally:
        os.close(fd)


def _enospc(fd, data):
    raise OSError(28, "No space left on device")
