"""common/supervisor.py alone: a process started by a supervisor gets SIGTERM when the supervisor dies, whether
it is the supervisor's own child (parent-death signal) or a grandchild (polling), and names the reason."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import ROOT

CHILD = """import signal, sys, time
from common.supervisor import STOP_SIGNALS, stop_reason, watch_supervisor
reasons = []
for sig in STOP_SIGNALS:
    signal.signal(sig, lambda n, _f: reasons.append(stop_reason(n)))
print("watch:", watch_supervisor(), flush=True)
deadline = time.monotonic() + 60
while not reasons and time.monotonic() < deadline:
    time.sleep(0.02)
print(reasons[0] if reasons else "never stopped", flush=True)
"""


@pytest.mark.parametrize("how", ["parent-death signal", "polling"])
def test_the_death_of_the_supervisor_stops_its_processes_with_the_reason(tmp_path, how):
    """The supervisor is a bash (as launch.sh): it starts the child directly (`exec`), or through a second
    bash that stays in between (the child then polls). SIGKILL the supervisor: the child stops by itself."""
    script, out = tmp_path / "child.py", tmp_path / "child.out"
    script.write_text(CHILD)
    start = (
        f"exec {sys.executable} {script}"
        if how == "parent-death signal"
        else f"bash -c '{sys.executable} {script}; true'"
    )
    sup = subprocess.Popen(
        ["bash", "-c", f"export DFLASH_SUPERVISOR_PID=$$; {start} >{out} 2>&1 & wait"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while "watch:" not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() < deadline, "the child did not start"
            time.sleep(0.02)
        assert out.read_text().splitlines()[0] == f"watch: {how}"
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(10)
        while len(out.read_text().splitlines()) < 2:
            assert time.monotonic() < deadline + 30, out.read_text()
            time.sleep(0.02)
        assert out.read_text().splitlines()[1] == f"stopped: its launch.sh (pid {sup.pid}) is gone"
    finally:
        subprocess.run(["pkill", "-KILL", "-g", str(sup.pid)], check=False)


def test_a_supervisor_already_gone_when_the_process_starts_is_noticed(tmp_path):
    """DFLASH_SUPERVISOR_PID names a process that has exited: the child is not its child, polls, and stops."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not Path(f"/proc/{gone.pid}").exists()
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DFLASH_SUPERVISOR_PID": str(gone.pid)},
    )
    assert done.stdout.splitlines() == ["watch: polling", f"stopped: its launch.sh (pid {gone.pid}) is gone"]


EXITING = """import os, signal, subprocess, sys, time
from common.supervisor import STOP_SIGNALS, watch_supervisor
for sig in STOP_SIGNALS:
    signal.signal(sig, lambda n, _f: None)  # a graceful stop: the process's own handler
watch_supervisor()
kill = f"while kill -{sys.argv[1]} {os.getpid()} 2>/dev/null; do :; done"  # ends when this pid is reaped
subprocess.Popen(["sh", "-c", kill], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(0.3)  # then exit 0, stop signals arriving all along
"""


@pytest.mark.parametrize("sig", ["TERM", "HUP", "INT"])
def test_a_stop_signal_while_the_process_exits_does_not_kill_it(tmp_path, sig):
    """Found in a loop of the launch tests (issue 36 item 8): SIGTERM to the whole group, then launch.sh's own
    SIGTERM; a consumer that had checkpointed got the second one while Python exited (its handler already
    replaced by the default action) and died with 143, so launch.sh returned 143. Before the fix: killed every time."""
    script = tmp_path / "exiting.py"
    script.write_text(EXITING)
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, str(script), sig],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
            capture_output=True,
        )
        assert done.returncode == 0, done
