"""launch.sh's own death and SIGHUP, through a real job (issue 24 items 4 and 5).

Found from outside: (4) launch.sh killed with SIGKILL mid-run left producer, consumers and telemetry running
under pid 1; telemetry never exited and kept the inherited job lock, so every later launch exited 75 naming
the dead launch.sh; control.endpoint, control.sock.lock and telemetry's sockets stayed. (5) SIGHUP to
launch.sh alone made it exit 129 and delete the ring and every socket while the job ran on as orphans;
SIGHUP to the whole group killed every process with no checkpoint (no handler).
One job, two launches of the same command: SIGKILL launch.sh (every process stops by itself within a bound,
consumers checkpoint; the rerun starts at once, not 75, and resumes); SIGHUP to the rerun's whole group
(every process stops gracefully, the consumer checkpoints, exit 0); then the exactly-once audit of the
lineage (a run to the end after reruns is tests/e2e/test_faults_launch.py's). SIGHUP to launch.sh alone is
tests/e2e/test_launch_supervision.py's (launch.sh then stops the group with SIGTERM, as tests/e2e/test_launch.py's)."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common.joblock import job_lock_path
from tests.e2e.test_faults_launch import accounting_check, log_text, pid_of, sockets_left, steps
from tests.jobs import finish, launch, ring_file, tiny_assets, wait_for, write_job

DRAFTERS = [
    {
        "name": "d0",
        "block_size": 8,
        "num_layers": 1,
        "anchors_per_seq": 16,
        "loss_chunk_rows": 64,
        "checkpoint_every": 50,
        "log_every": 1,
    },
]
STOP_BOUND_S = 60.0  # every orphan of a dead launch.sh must be gone within this
pytestmark = pytest.mark.slow


def group_pids(pgid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def started(run: Path, launches: int, after_step: int = 0) -> bool:
    """The `launches`-th launch's consumer attached and trained past `after_step`."""
    return log_text(run, "producer").count("attached; its group resumes") >= launches and steps(run, "d0") > after_step


def saved(run: Path) -> int:
    return log_text(run, "consumer-d0-r0").count("d0_r0: checkpoint at step")


def test_launch_sh_killed_or_hung_up_stops_its_group_gracefully_and_the_same_command_resumes(tmp_path_factory):
    job = write_job(  # 20 epochs: the rerun is provably still training when its SIGHUP comes (issue 36 item 8)
        tiny_assets(tmp_path_factory.mktemp("assets")), drafters=DRAFTERS, tokens_per_batch=1024, epochs=20, name="sup"
    )
    run = job.parent
    procs = []
    try:
        # 1. SIGKILL launch.sh: its processes get SIGTERM from the kernel and stop as if launch.sh had sent it
        first = launch(job, "--grace", "60")
        procs.append(first)
        wait_for(lambda: started(run, 1), 240, "training to start", first)
        children = group_pids(first.pid)
        assert len(children) >= 3, children  # telemetry, producer, consumer (launch.sh itself too)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        second = launch(job, "--grace", "60")  # at once: its start waits for the orphans, never refuses (75)
        procs.append(second)
        deadline = time.monotonic() + STOP_BOUND_S
        while any(running(p) for p in children):
            assert time.monotonic() < deadline, [p for p in children if running(p)]
            time.sleep(0.1)
        assert f"stopped: its launch.sh (pid {first.pid}) is gone at step" in log_text(run, "consumer-d0-r0")
        assert saved(run) == 1
        assert f"stopped: its launch.sh (pid {first.pid}) is gone: flushing" in log_text(run, "telemetry")
        killed_at = steps(run, "d0")
        wait_for(lambda: started(run, 2, killed_at), 240, "the rerun to attach and train", second)
        assert "resumed from" in log_text(run, "consumer-d0-r0")

        # 2. SIGHUP to the whole group (a closed terminal): every process handles it as a graceful stop
        roles = {m: pid_of(second.pid, m) for m in ("telemetry", "producer", "consumer")}
        assert second.poll() is None and all(p and running(p) for p in roles.values()), roles  # right before
        os.killpg(second.pid, signal.SIGHUP)
        out = finish(second, 120)
        assert second.returncode == 0, out
        assert "launch.sh: SIGHUP received: stopping the job" in out and "SIGKILL" not in out, out
        assert log_text(run, "consumer-d0-r0").count("d0_r0: stopped by SIGHUP at step") == 1
        assert "stopped by SIGHUP" in log_text(run, "producer") and "stopped by SIGHUP" in log_text(run, "telemetry")
        assert saved(run) == 2 and group_pids(second.pid) == []
        assert not ring_file(job).exists() and sockets_left(run) == []
        assert not (run / "sockets" / "control.endpoint").exists()
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    check = accounting_check(run)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.startswith("d0: ok: ") and "duplicates 0/0" in check.stdout, check.stdout
    assert not ring_file(job).exists() and sockets_left(run) == []
    lock = job_lock_path(run, 0)
    assert subprocess.run(["flock", "-n", str(lock), "true"]).returncode == 0  # nobody holds the job
