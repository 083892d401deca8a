"""The process list of a job, derived from the job file alone (launch.sh and systemd read it from here).

    python -m common.launch_plan JOB.toml [--node-rank R --nnodes N]       # one process per line

Each line: `name critical log_path command...` separated by tabs, the command's words shell-quoted.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass

from common.config import ConfigError, JobConfig, load_job


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    argv: list[str]
    critical: bool  # its death tears the job down; telemetry's does not (it is restarted)
    log: str


def plan(job: JobConfig, job_path: str, python: str, node_rank: int = 0, nnodes: int = 1) -> list[ProcessSpec]:
    logs = job.run_paths.logs
    node = ["--node-rank", str(node_rank), "--nnodes", str(nnodes)]
    procs = [
        ProcessSpec("telemetry", [python, "-m", "telemetry", "--job", job_path], False, str(logs / "telemetry.log")),
        ProcessSpec("producer", [python, "-m", "producer", "--job", job_path, *node], True,
                    str(logs / "producer.log")),
    ]
    for d in job.drafters:
        for r in range(d.replicas):
            name = f"consumer-{d.name}-r{r}"
            procs.append(ProcessSpec(
                name, [python, "-m", "consumer", "--job", job_path, "--drafter", d.name, "--replica", str(r), *node],
                True, str(logs / f"{name}.log"),
            ))
    return procs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.launch_plan", description=__doc__.splitlines()[0])
    ap.add_argument("job")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--node-rank", type=int, default=int(os.environ.get("NODE_RANK", 0)))
    ap.add_argument("--nnodes", type=int, default=int(os.environ.get("NNODES", 1)))
    args = ap.parse_args(argv)
    try:
        job = load_job(args.job)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    job.run_paths.make()
    for p in plan(job, os.path.abspath(args.job), args.python, args.node_rank, args.nnodes):
        print(f"{p.name}\t{int(p.critical)}\t{p.log}\t{shlex.join(p.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
