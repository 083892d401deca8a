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
