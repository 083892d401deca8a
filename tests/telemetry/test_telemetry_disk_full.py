"""A full disk under metrics.jsonl (issue 36 §4): telemetry drops and counts the windows it cannot write, says so
in its log and on the stats line, keeps serving the live view, and writes again once there is room."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.soak_faults import fill, unfill
from telemetry.cli import dropped_note, summary
from telemetry.progress import Display, Drafter
from telemetry.sinks import JsonlSink
from tests.telemetry.test_telemetry_integration import ROOT, cli, python_env, write_job

INTEGRATION = ROOT / "tests" / "telemetry" / "test_telemetry_integration.py"  # also the stand-in publisher


def test_a_write_that_fails_is_dropped_counted_truncated_back_and_the_recovery_said(tmp_path, monkeypatch, caplog):
    path = tmp_path / "telemetry" / "metrics.jsonl"
    sink = JsonlSink(path, logging.getLogger("t"))
    assert sink.write({"window": 1})
    real_write = os.write

    def half_then_full(fd, data):  # a disk that fills in the middle of a line
        if len(data) > 4:
            return real_write(fd, bytes(data[:4]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("telemetry.sinks.os.write", half_then_full)
    with caplog.at_level(logging.INFO):
        assert not sink.write({"window": 2})
        assert not sink.write({"window": 3})
    assert (sink.dropped, sink.error) == (2, "No space left on device")
    assert path.read_text() == '{"window": 1}\n'  # the torn part was truncated away
    assert caplog.text.count(f"cannot write {path} (No space left on device): windows are dropped") == 1
    monkeypatch.setattr("telemetry.sinks.os.write", real_write)
    assert sink.write({"window": 4})
    assert f"{path} is writable again: 2 window(s) were dropped (No space left on device)" in caplog.text
    assert [json.loads(line)["window"] for line in path.read_text().splitlines()] == [1, 4]
    assert (sink.dropped, sink.error) == (2, None)
    health = {"jsonl_dropped": 2, "jsonl_error": "No space left on device"}
    state = {"ring": {}, "pipeline": {"tokens_per_s": None}, "health": health}
    assert "| metrics.jsonl: 2 window(s) not written (No space left on device)" in summary(state)


@pytest.fixture
def small_disk(tmpfs):
    return tmpfs(1024)


def _wait(what: str, ok, proc: subprocess.Popen, log: Path, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = ok()
        if got:
            return got
        assert proc.poll() is None, f"telemetry exited ({proc.returncode}) waiting for {what}:\n{log.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout_s} s:\n{log.read_text()}")


def test_telemetry_on_a_full_disk_keeps_serving_and_writes_again_when_there_is_room(small_disk, tmp_path):
    run_dir = small_disk / "run"
    job = write_job(run_dir, tmp_path / "job.toml", wandb_mode="disabled")
    log = tmp_path / "telemetry.log"  # off the full disk, as launch.sh's tail of it is
    metrics = run_dir / "telemetry" / "metrics.jsonl"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "telemetry", "--job", str(job)], cwd=ROOT, env=python_env(), stdout=out, stderr=out
        )
    worker = subprocess.Popen(  # a publisher, so the stats command has a process to show
        [
            sys.executable,
            str(INTEGRATION),
            "worker",
            "--job",
            str(job),
            "--role",
            "consumer",
            "--name",
            "d0_r0",
            "--stop-file",
            str(tmp_path / "stop"),
        ],
        cwd=ROOT,
        env=python_env(),
        stdout=subprocess.DEVNULL,
    )
    try:
        _wait("a first window", lambda: metrics.is_file() and metrics.stat().st_size > 0, proc, log)
        fill(small_disk, leave_bytes=0)
        _wait("a dropped window", lambda: "windows are dropped and counted" in log.read_text(), proc, log)
        time.sleep(2.0)  # several windows on the full disk: still running (before, it crash-looped)
        assert proc.poll() is None, log.read_text()
        shown = cli("--job", str(job), "--json")
        assert shown.returncode == 0, shown.stderr
        health = json.loads(shown.stdout)["health"]
        assert health["jsonl_dropped"] >= 2 and health["jsonl_error"] == "No space left on device"
        once = cli("--job", str(job), "--once")
        assert "metrics.jsonl:" in once.stdout and "window(s) not written (No space left on device)" in once.stdout
        assert all(json.loads(line) for line in metrics.read_text().splitlines())  # whole lines only
        lines_full = len(metrics.read_text().splitlines())
        unfill(small_disk)
        _wait("the recovery line", lambda: "is writable again" in log.read_text(), proc, log)
        _wait("a new window", lambda: len(metrics.read_text().splitlines()) > lines_full, proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        for p in (proc, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
        unfill(small_disk)
    text = log.read_text()
    assert "Traceback" not in text and text.count("windows are dropped and counted") == 1
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["health"]["jsonl_dropped"] >= 2 and last["health"]["jsonl_error"] is None


def test_the_progress_line_carries_the_dropped_windows_and_prints_again_when_they_change():
    out = io.StringIO()
    display = Display(out, every_s=30.0)
    d = Drafter("d0", 100, state="live", step=10, loss=1.0, tau=2.0, tokens_per_s=500.0)
    display.show([d], 0.0)
    display.show([d], 1.0)  # nothing new within every_s
    note = dropped_note({"jsonl_dropped": 3, "jsonl_error": "No space left on device"}, " | ")
    display.show([d], 2.0, note)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and not lines[0].endswith("not written (No space left on device)")
    assert lines[1].endswith("| metrics.jsonl: 3 window(s) not written (No space left on device)")
