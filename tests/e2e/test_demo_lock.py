"""Two demos at once (issue 36 §6): building the demo's assets holds the job lock, so a second `./launch.sh`
(or `python -m demo prepare`) of the same folder is refused, naming the holder, and touches nothing.

The first build is held still with SIGSTOP once it holds the lock: the second one provably meets a build in
progress, however fast the quick build is."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env(run_dir: Path) -> dict:
    return {
        **os.environ,
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "DEMO_QUICK": "1",
        "DEMO_RUN_DIR": str(run_dir),
        "DFLASH_PLOTS": "0",
    }


def _wait_for(predicate, what: str, timeout_s: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc is None or proc.poll() is None, f"{what}: the first process ended first (rc {proc.returncode})"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f}s"
        time.sleep(0.05)


def _lock_says(run_dir: Path, word: str) -> bool:
    try:
        return word in (run_dir / "job-n0.lock").read_text().split()
    except OSError:
        return False


def test_a_second_prepare_during_a_build_is_refused_naming_the_builder(tmp_path):
    run_dir = tmp_path / "demo"
    cmd = [sys.executable, "-m", "demo", "prepare", str(run_dir), "--quick"]
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _lock_says(run_dir, f"pid={first.pid}"), "the build's lock stamp", proc=first)
        first.send_signal(signal.SIGSTOP)  # mid-build, holding the lock
        second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 75, second.stderr
    assert f"is in use by python -m demo prepare pid {first.pid}" in second.stderr
    assert "python -m demo prepare not started" in second.stderr
    assert "building" not in second.stderr  # it touched nothing
    assert first.returncode == 0, err[-2000:]
    assert out.strip() == str(run_dir / "demo.toml")
    assert (run_dir / "assets" / "READY").is_file() and (run_dir / "assets" / "target" / "config.json").is_file()


def test_a_second_demo_launch_while_the_first_builds_is_refused_and_the_first_keeps_its_assets(tmp_path):
    run_dir = tmp_path / "demo"
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(
        [str(ROOT / "launch.sh")], cwd=ROOT, env=_env(run_dir), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(lambda: _lock_says(run_dir, f"pid={first.pid}"), "the first launch's lock stamp", proc=first)
        _wait_for(lambda: (run_dir / "assets" / "corpus.jsonl").is_file(), "the first build's corpus", proc=first)
        os.killpg(first.pid, signal.SIGSTOP)  # the first launch and its build, mid-build
        corpus = (run_dir / "assets" / "corpus.jsonl").stat()
        second = subprocess.run(
            [str(ROOT / "launch.sh")], cwd=ROOT, env=_env(run_dir), capture_output=True, text=True, timeout=120
        )
        after = (run_dir / "assets" / "corpus.jsonl").stat()
    finally:
        os.killpg(first.pid, signal.SIGCONT)
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=120)
        log.close()
    assert second.returncode == 75, second.stdout + second.stderr
    assert "is in use by a running launch of this job; not starting a second one" in second.stderr
    assert f"launch.sh pid {first.pid}" in second.stderr
    assert "preparing the embedded demo job" not in second.stdout  # refused before the demo was touched
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (corpus.st_ino, corpus.st_mtime_ns, corpus.st_size)
