"""A job's process notices the death of the launch.sh that started it, and stops as if it had been told to.

launch.sh exports its pid as $DFLASH_SUPERVISOR_PID. Without a supervisor (killed with SIGKILL, say) its
processes would run on under pid 1 holding the job lock, so every later launch of the job would be refused.

How: the kernel's parent-death signal (prctl PR_SET_PDEATHSIG). It is sound here because launch.sh execs each
process directly from a single-threaded bash (the "parent thread" that must die is bash itself), and the
setting survives the exec of non-set-uid programs; it is set by the process itself, then getppid() is checked
once more, so a supervisor that died before the prctl is not missed. A process that is not launch.sh's own
child (wrapped by another program) polls the supervisor's pid once a second instead. Either way the process
receives SIGTERM: its ordinary graceful stop (consumers checkpoint at a step boundary, then exit).

A stop signal that comes while the interpreter exits is ignored: Python puts back the default action of its
handled signals late in its exit, and the second stop signal that launch.sh sends after a SIGHUP/SIGINT to
the whole group would then kill a process that had just checkpointed (status 143 instead of 0).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import threading
import time

SUPERVISOR_ENV = "DFLASH_SUPERVISOR_PID"
PR_SET_PDEATHSIG = 1
POLL_S = 1.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # each one a graceful stop, in every process


def supervisor_pid() -> int | None:
    """launch.sh's pid, when this process was started by one."""
    raw = os.environ.get(SUPERVISOR_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 1 else None


def supervisor_gone() -> bool:
    """Whether this process had a supervisor and it has died."""
    pid = supervisor_pid()
    return pid is not None and os.getppid() != pid and not running(pid)


def stop_reason(signum: int) -> str:
    """Why a stop signal came: the supervisor's death (the parent-death signal), or the signal someone sent."""
    if signum == signal.SIGTERM and supervisor_gone():
        return f"stopped: its launch.sh (pid {supervisor_pid()}) is gone"
    return f"stopped by {signal.Signals(signum).name}"


def running(pid: int) -> bool:
    """Running (a zombie, killed but not yet collected by its parent, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def ignore_stops_at_exit() -> None:
    """Stop signals are ignored from the last exit handler on (a handled one would get its default back)."""
    atexit.register(lambda: [signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS])


def watch_supervisor(log: logging.Logger | None = None) -> str:
    """Arrange for SIGTERM to this process when its launch.sh dies; returns how ("" without a supervisor).
    A stop signal during the interpreter's exit is ignored, supervised or not."""
    ignore_stops_at_exit()
    pid = supervisor_pid()
    if pid is None:
        return ""
    if os.getppid() == pid:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != pid:  # it died before the prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
        return "parent-death signal"
    threading.Thread(target=_poll, args=(pid, log), name="supervisor-watch", daemon=True).start()
    return "polling"


def _poll(pid: int, log: logging.Logger | None) -> None:
    while True:
        time.sleep(POLL_S)
        if not running(pid):
            if log:
                log.warning("launch.sh (pid %d) is gone: stopping", pid)
            os.kill(os.getpid(), signal.SIGTERM)
            return
