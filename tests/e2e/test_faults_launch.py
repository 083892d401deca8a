"""Faults from outside, through launch.sh and real processes: a producer SIGKILLed at different moments and the
same command run again (exactly once, ring and sockets removed), a second launch of a running job, SIGTERM
and a producer failure while the consumers wait for the producer."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import ROOT, finish, launch, ring_file, tiny_assets, wait_for, write_job

DRAFTERS = [
    {
        "name": "d0",
        "block_size": 8,
        "num_layers": 1,
        "anchors_per_seq": 16,
        "loss_chunk_rows": 64,
        "checkpoint_every": 4,
        "log_every": 1,
    },
    {
        "name": "d1",
        "block_size": 4,
        "num_layers": 1,
        "anchors_per_seq": 8,
        "loss_chunk_rows": 64,
        "checkpoint_every": 3,
        "log_every": 1,
    },
]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


def log_text(run: Path, name: str) -> str:
    path = run / "logs" / f"{name}.log"
    return path.read_text() if path.exists() else ""


def steps(run: Path, drafter: str) -> int:
    lines = [li for li in log_text(run, f"consumer-{drafter}-r0").splitlines() if f"{drafter}_r0 step " in li]
    return int(lines[-1].split(" step ")[1].split()[0]) if lines else 0


def pid_of(pgid: int, module: str) -> int | None:
    found = subprocess.run(["pgrep", "-g", str(pgid), "-f", "--", f"-m {module} "], capture_output=True, text=True)
    return int(found.stdout.split()[0]) if found.stdout.strip() else None


def accounting_check(run: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "common.accounting_check", str(run)], cwd=ROOT, capture_output=True, text=True
    )


def sockets_left(run: Path) -> list[Path]:
    return [p for p in (run / "sockets").iterdir() if p.is_socket()] if (run / "sockets").exists() else []


def test_producer_sigkills_at_two_moments_reruns_and_a_second_launch_leave_every_sample_trained_once(assets):
    """Found from outside: (1) after a producer SIGKILL and a rerun, accounting_check failed ("204 distinct
    samples trained, the plan has 240") while its own summary said "lost samples 0, missing 0": the producer's
    job log kept its last second of deliveries in memory and the SIGKILL took them; the ring and the control
    socket stayed behind until the next start. (2) A second `./launch.sh JOB.toml` attached its consumers to
    the FIRST producer under the same names, rewound the cursor, tore the first job down and left two
    checkpoint lineages; its terminal showed the first producer's log tail.
    One job: SIGKILL its producer soon after training starts, run the same command again, SIGKILL it again a
    few steps later, run it again and launch it a second time while it runs; then audit the job log."""
    job = write_job(assets, drafters=DRAFTERS, tokens_per_batch=2048, name="pkill")
    run = job.parent
    procs = []
    try:
        kill_at = 1
        for _ in range(2):
            proc = launch(job, "--grace", "60")
            procs.append(proc)
            wait_for(lambda: steps(run, "d0") >= kill_at, 240, f"training to reach step {kill_at}", proc)  # noqa: B023
            os.kill(pid_of(proc.pid, "producer"), signal.SIGKILL)
            out = finish(proc, 120)
            assert proc.returncode == 128 + signal.SIGKILL, out
            assert not ring_file(job).exists() and sockets_left(run) == [], out  # removed by launch.sh
            kill_at = steps(run, "d0") + 5
        last = launch(job, "--grace", "60")
        procs.append(last)
        wait_for(
            lambda: log_text(run, "producer").count("attached; its group resumes") >= 6,
            240,
            "the last run's consumers to attach",
            last,
        )
        incarnations = sorted(p.name for p in (run / "accounting").iterdir())
        second = launch(job, "--grace", "60")
        out2 = finish(second, 60)
        assert second.returncode == 75, out2
        assert f"launch.sh pid {last.pid} (started " in out2, out2
        assert "launch.sh: started" not in out2 and "producer.log" not in out2, out2  # its own reason only
        assert sorted(p.name for p in (run / "accounting").iterdir()) == incarnations  # it started nothing
        out = finish(last, 600)
        assert last.returncode == 0, out
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    check = accounting_check(run)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(": ok:") == 2 and check.stdout.count("; complete") == 2, check.stdout
    assert not ring_file(job).exists() and sockets_left(run) == []


def standin_plan(job: Path, producer_cmd: str) -> Path:
    """The real plan with the producer replaced by a stand-in: the consumers wait for a producer that never
    listens, as they do while a real one loads a large target."""
    plan = subprocess.run(
        [sys.executable, "-m", "common.launch_plan", str(job)], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    lines = []
    for line in plan.splitlines():
        name, critical, log, cmd = line.split("\t", 3)
        lines.append("\t".join([name, critical, log, producer_cmd if name == "producer" else cmd]))
    path = job.parent / "plan.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


def consumers_waiting(run: Path) -> bool:
    return all(" on cpu (pid " in log_text(run, f"consumer-{d}-r0") for d in ("d0", "d1"))


def test_sigterm_while_the_consumers_wait_for_the_producer_ends_the_job_at_once(assets):
    """Found from outside: SIGTERM during start-up was ignored until the grace period ended and everything
    was SIGKILLed (exit 143). The grace here is longer than the test waits: only a job that honours the
    signal returns in time."""
    job = write_job(assets, drafters=DRAFTERS, name="termstart")
    run = job.parent
    standin = run / "standin_producer.sh"  # stops cleanly on SIGTERM, as a real producer waiting for consumers
    standin.write_text("trap 'kill $pid; exit 0' TERM\nsleep 600 & pid=$!\nwait\n")
    plan = standin_plan(job, f"sh {standin}")
    proc = launch(job, "--grace", "300", plan=plan)
    try:
        wait_for(lambda: consumers_waiting(run), 240, "both consumers to wait for the producer", proc)
        os.killpg(proc.pid, signal.SIGTERM)
        out = finish(proc, 120)
        assert proc.returncode == 0, out
        assert "SIGKILL" not in out
        for d in ("d0", "d1"):
            assert "stopped by SIGTERM" in log_text(run, f"consumer-{d}-r0")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_producer_failing_during_start_up_ends_the_job_at_once_with_its_own_reason(assets):
    """Found from outside: every producer start-up failure cost 65 s (the consumers, waiting for it, ignored
    SIGTERM until the grace ended), and the terminal could show an earlier run's log tail."""
    job = write_job(assets, drafters=DRAFTERS, name="failstart")
    run = job.parent
    (run / "logs").mkdir(parents=True, exist_ok=True)
    (run / "logs" / "producer.log").write_text("an earlier run's last line\n")
    go = run / "go"
    reason = "producer ERROR data.path /nowhere/train.jsonl: no such file"
    plan = standin_plan(job, f"sh -c 'while [ ! -e {go} ]; do sleep 0.1; done; echo \"{reason}\" >&2; exit 2'")
    proc = launch(job, "--grace", "300", plan=plan)
    try:
        wait_for(lambda: consumers_waiting(run), 240, "both consumers to wait for the producer", proc)
        go.touch()
        out = finish(proc, 120)
        assert proc.returncode == 2, out
        assert "producer exited with status 2" in out and reason in out, out
        assert "an earlier run's last line" not in out and "SIGKILL" not in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
