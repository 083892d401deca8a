"""What bench and tests both need to run a job's processes: a free TCP port, `python ARGS` as a job's process,
a job file written from the validated config. Tests import this module; bench imports nothing from tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from common.config import JobConfig
from common.job_file import write_job_file

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on the loopback now (a replica group's MASTER_PORT, a server's port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list, log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """`python ARGS` run from the repository as a job's process (one OpenMP thread unless `env` says more),
    `env` added to this process's environment, stdout and stderr appended to `log`."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "a") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, *map(str, args)], cwd=ROOT, env=full, stdout=out, stderr=subprocess.STDOUT
        )


def write_job(path: Path, job: JobConfig | Mapping, *, header: str = "") -> Path:
    """`job` (a validated JobConfig, or a dict validated through one) as the TOML file `path`."""
    return write_job_file(path, job, header=header)
