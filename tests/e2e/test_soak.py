"""The fault-injection soak, short: every fault kind but launch_kill (tests/e2e/test_launch_signals.py) at least once,
then nothing lost, repeated or leaked.

Runs bench.soak in its own process (it starts and kills a whole job). One pass of the seeded shuffle: each
kind once (--duration 0; the kinds, their order and their checks are the long soak's), 0.2-0.6 s of calm
before each fault instead of 1-3 s (--pause 0.4: every fault waits for its own precondition and recovery).
The checkpoint_enospc kind mounts a tmpfs and is left out when not running as root.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import KINDS, main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_short_soak_with_every_fault_kind_loses_repeats_and_leaks_nothing():
    # launch_kill hands the job to launch.sh and starts it twice (about a minute idle): CI runs that fault through
    # real processes in tests/e2e/test_launch_signals.py instead; `python -m bench.soak` runs every kind
    skip = {"launch_kill"} | (set() if os.geteuid() == 0 else {"checkpoint_enospc"})
    kinds = tuple(k for k in KINDS if k not in skip)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--duration",
            "0",
            "--pause",
            "0.4",
            "--seed",
            "3",
            "--json",
            "--kinds",
            ",".join(kinds),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.stdout.strip(), done.stderr[-3000:]
    doc = json.loads(done.stdout.splitlines()[-1])
    detail = json.dumps(doc, indent=1) + done.stderr[-3000:]
    assert doc["failed_faults"] == [], detail
    for kind in kinds:
        assert doc["faults"].get(kind, 0) >= 1 and doc["recoveries"].get(kind) == doc["faults"][kind], detail
    assert doc["duplicates"] == 0 and doc["lost_samples"] == 0 and doc["missing_batches"] == 0, detail
    assert doc["accounting_errors"] == [], detail
    assert doc["leaked_shm"] == 0 and doc["leaked_sockets"] == 0, detail
    assert all(n > 0 for n in doc["batches_trained"].values()), detail
    for lost, retrained in doc["lost_in_crashes_then_retrained"].values():
        assert lost == retrained, detail  # what a crash threw away was trained again, once
    assert set(doc["exit_codes"].values()) == {0}, detail
    assert doc["ok"] and done.returncode == 0, detail


def test_a_negative_pause_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--pause", "-1", "--kinds", "consumer_kill"])
    assert refused.value.code == 2 and "--pause must be >= 0 seconds, not -1.0" in capsys.readouterr().err
