"""launch.sh's own machinery, with stand-in processes (DFLASH_LAUNCH_PLAN_FILE): supervision of exits that
happen together, the job lock, and the removal of the job's ring and sockets however the group ended."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from common.joblock import JobLocked, enter
from tests.jobs import ROOT, finish, launch, ring_file


@pytest.fixture
def job(tmp_path):
    """A job file whose processes the tests replace by stand-ins (only its name and run folder matter)."""
    run_dir = Path(tempfile.mkdtemp(prefix="dfl-", dir="/tmp"))
    path = tmp_path / "job.toml"
    path.write_text(f'[job]\nname = "standin-{run_dir.name[4:]}"\nrun_dir = "{run_dir}"\n[target]\npath = "unused"\n'
                    '[data]\npath = "unused"\n[[drafters]]\nname = "d0"\n')
    yield path
    subprocess.run(["rm", "-rf", str(run_dir)], check=False)


def run_dir_of(job: Path) -> Path:
    return Path(job.read_text().split('run_dir = "')[1].split('"')[0])


def plan_file(job: Path, procs: list[tuple[str, int, str]]) -> Path:
    """(name, critical, shell command) per stand-in, in launch_plan's format."""
    path = job.parent / "plan.tsv"
    logs = run_dir_of(job) / "logs"
    path.write_text("".join(f"{n}\t{c}\t{logs / n}.log\tsh -c '{cmd}'\n" for n, c, cmd in procs))
    return path


def test_processes_that_exit_at_the_same_instant_are_all_collected_every_time(job):
    """Found from outside: the bookkeeping around `wait -n` dropped processes that exited together, so
    launch.sh waited forever on telemetry (one 'finished' line missing). 4 stand-ins wait for one file and
    exit at once; telemetry's stand-in runs until stopped. 50 rounds, alternating success and failure."""
    go = job.parent / "go"
    wait_go = f"while [ ! -e {go} ]; do sleep 0.01; done"
    for rnd in range(50):
        fail = rnd % 2 == 1
        go.unlink(missing_ok=True)
        plan = plan_file(job, [("telemetry", 0, "exec sleep 600")] + [
            (f"c{i}", 1, f"{wait_go}; exit {3 if fail and i == 2 else 0}") for i in range(4)])
        proc = launch(job, "--grace", "20", plan=plan)
        deadline = time.monotonic() + 60
        logs = run_dir_of(job) / "logs"
        while not all((logs / f"c{i}.log").exists() for i in range(4)):
            assert time.monotonic() < deadline and proc.poll() is None, "the stand-ins did not start"
            time.sleep(0.02)
        go.touch()
        out = finish(proc, 60)
        assert proc.returncode == (3 if fail else 0), f"round {rnd}:\n{out}"
        if not fail:
            assert out.count("finished") == 4, f"round {rnd}:\n{out}"
        assert subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 1  # none left


def test_a_second_launch_is_refused_at_once_naming_the_holder_and_the_first_runs_on(job):
    go = job.parent / "go"
    plan = plan_file(job, [("telemetry", 0, "exec sleep 600"),
                           ("worker", 1, f"while [ ! -e {go} ]; do sleep 0.05; done")])
    first = launch(job, plan=plan)
    try:
        lock = run_dir_of(job) / "job-n0.lock"
        deadline = time.monotonic() + 30
        while "launch=" not in (lock.read_text() if lock.exists() else ""):
            assert time.monotonic() < deadline and first.poll() is None, "the first launch did not lock the job"
            time.sleep(0.05)
        second = launch(job, plan=plan)
        out = finish(second, 60)
        assert second.returncode == 75, out
        assert f"launch.sh pid {first.pid} (started " in out and "not starting a second one" in out
        assert "started worker" not in out  # it started nothing
        with pytest.raises(JobLocked, match=f"in use by launch.sh pid {first.pid}"):  # nor may a process by hand
            enter(run_dir_of(job), "producer")
        assert first.poll() is None
        go.touch()
        out = finish(first, 60)
        assert first.returncode == 0 and "worker finished" in out, out
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)


def test_processes_started_by_hand_share_the_job_but_not_their_own_place(job):
    run_dir = run_dir_of(job)
    producer = enter(run_dir, "producer")
    consumer = enter(run_dir, "consumer-d0-r0")
    try:
        assert producer.launch_id == consumer.launch_id == ""
        code = ("import sys; from common.joblock import enter, JobLocked\n"
                f"try:\n    enter({str(run_dir)!r}, 'producer')\nexcept JobLocked as e:\n    print(e); sys.exit(9)")
        other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
        assert other.returncode == 9 and f"another producer pid {os.getpid()}" in other.stdout
        plan = plan_file(job, [("worker", 1, "exit 0")])
        out = finish(launch(job, plan=plan), 60)  # nor may launch.sh start the job they run
        assert "not starting a second one" in out and f"producer pid {os.getpid()}" in out
    finally:
        producer.release()
        consumer.release()


def test_the_ring_and_sockets_are_removed_when_a_process_of_the_group_was_killed(job):
    run_dir = run_dir_of(job)
    ring = ring_file(job)
    (run_dir / "sockets").mkdir(parents=True)
    sock_path = run_dir / "sockets" / "control.sock"
    made = job.parent / "made"
    # the stand-in producer leaves what a SIGKILLed producer leaves: its ring file and a bound socket file
    script = job.parent / "standin_producer.py"
    script.write_text(f"import socket, os, pathlib\nopen({str(ring)!r}, 'w').close()\ns = socket.socket(socket.AF_UNIX)\n"
                      f"s.bind({str(sock_path)!r})\npathlib.Path({str(made)!r}).touch()\nos.kill(os.getpid(), 9)\n")
    plan = plan_file(job, [("telemetry", 0, "exec sleep 600"), ("producer", 1, f"exec {sys.executable} {script}"),
                           ("consumer", 1, "exec sleep 600")])
    try:
        proc = launch(job, "--grace", "20", plan=plan)
        out = finish(proc, 60)
        assert proc.returncode == 128 + signal.SIGKILL, out
        assert made.exists(), out
        assert not ring.exists() and not sock_path.exists()
        left = [p for p in (run_dir / "sockets").iterdir() if p.is_socket()]
        assert left == []
    finally:
        ring.unlink(missing_ok=True)


def test_an_entry_point_run_in_process_gives_its_place_back_when_it_returns(job):
    """bench.entry_worker calls `main()` of producer/consumer again and again in one process: the lock of a
    finished run must not refuse the next one."""
    run_dir = run_dir_of(job)

    def main() -> str:
        lock = enter(run_dir, "consumer-d0-r0")
        return lock.launch_id

    assert main() == "" and main() == ""
    held = enter(run_dir, "consumer-d0-r0")
    with pytest.raises(JobLocked, match=f"another consumer-d0-r0 pid {os.getpid()}"):
        main()
    held.release()
    assert main() == ""
