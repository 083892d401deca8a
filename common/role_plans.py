"""The roles' plan subcommands and the dry run's one plan process per role.

Each role plans its own processes (common imports no role): `python -m ROLE memory-plan` (its GPU memory
entries, common/memory_plan.py), `python -m ROLE throughput-plan` (its stages' work a batch,
common/throughput_plan.py) and `python -m ROLE plan`, both in one process, which `launch.sh --dry-run`
starts: the role's torch and transformers import (about 3.3 CPU-s) is paid once, not once per plan. All
three are `plan_command`, given the role's input reader and planners.

    python -m ROLE plan JOB [--target-config DIR] [--sample-tokens N]
        one JSON line per item: {"memory": ProcessMemory} lines, then {"work": Work} lines

`run_role_plans` starts the two roles' `plan` side by side and parses what they print.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from common.config import ConfigError, JobConfig, load_job
from common.memory_plan import ProcessMemory
from common.throughput_plan import Work

ROLES = ("producer", "consumer")
# both roles' plans together, side by side: the memory plan's 600 s and the throughput plan's 300 s they had
# as two commands a role
PLAN_TIMEOUT_S = 900

ReadConfig = Callable[[JobConfig, str], Any]
PlanMemory = Callable[[JobConfig, Any], list[ProcessMemory]]
PlanWork = Callable[[JobConfig, Any, int], list[Work]]


class PlanInputError(Exception):
    """One line: the target's config.json a plan subcommand could not read (the message names the path)."""


def plan_command(
    role: str,
    command: str,
    argv: list[str],
    description: str,
    read_config: ReadConfig,
    memory: PlanMemory | None = None,
    work: PlanWork | None = None,
) -> int:
    """`python -m ROLE COMMAND JOB ...`: the job and its target's config (`--target-config` or target.path, read
    by `read_config`), then the role's memory entries (`memory`), its work (`work`), or both (`plan`).
    Exit 2 with one line naming the role, the command and the file when an input cannot be read."""
    ap = argparse.ArgumentParser(prog=f"python -m {role} {command}", description=description)
    ap.add_argument("job")
    ap.add_argument("--target-config", default=None, help="the target's model directory (default: target.path)")
    if work:
        ap.add_argument("--sample-tokens", type=int, default=None, help="mean sample length (default: data.max_length)")
    if memory and not work:
        ap.add_argument("--json", action="store_true", help="one JSON line per process and device")
    args = ap.parse_args(argv)
    try:
        job = load_job(args.job)
        config = read_config(job, args.target_config or job.target.path)
        entries = memory(job, config) if memory else []
        sample = min(args.sample_tokens or job.data.max_length, job.data.tokens_per_batch) if work else 0
        works = work(job, config, sample) if work else []
    except (ConfigError, PlanInputError) as err:
        print(f"{role} {command}: {err}", file=sys.stderr)
        return 2
    for e in entries:
        if work:
            print(json.dumps({"memory": asdict(e)}))
        else:
            print(e.to_json() if args.json else f"{e.process} {e.device} {json.dumps(e.parts)}")
    for w in works:
        print(w.to_json())
    return 0


@dataclass
class RolePlans:
    """Both roles' plans; `failure` the first role's one-line reason when one failed (nothing else is kept)."""

    memory: list[ProcessMemory] = field(default_factory=list)
    works: list[Work] = field(default_factory=list)
    failure: str | None = None


def parse_plan_lines(out: str, plans: RolePlans) -> None:
    """Add the `{"memory": ...}` and `{"work": ...}` lines of a role's `plan` output to `plans`."""
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        item = json.loads(line)
        if "memory" in item:
            plans.memory.append(ProcessMemory.from_dict(item["memory"]))
        elif "work" in item:
            plans.works.append(Work.from_dict(item["work"]))


def plan_commands(python: str, job_path: str, target_config: str | None, sample_tokens: int) -> dict[str, list[str]]:
    """The command each role's plan runs as, by role."""
    extra = ["--target-config", target_config] if target_config else []
    return {
        role: [python, "-m", role, "plan", job_path, "--sample-tokens", str(sample_tokens), *extra] for role in ROLES
    }


def run_role_plans(
    python: str, job_path: str, target_config: str | None, sample_tokens: int, timeout_s: float = PLAN_TIMEOUT_S
) -> RolePlans:
    """Both roles' `plan` processes, side by side (each takes seconds of CPU), parsed; the first to fail names
    itself in `failure` (its last line of stderr, or that it took over `timeout_s`)."""
    procs = {
        role: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for role, argv in plan_commands(python, job_path, target_config, sample_tokens).items()
    }
    deadline = time.monotonic() + timeout_s
    plans = RolePlans()
    for role, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            plans.failure = plans.failure or f"{role} plan took over {timeout_s:g} s"
            continue
        if proc.returncode != 0:
            plans.failure = plans.failure or (err.strip().splitlines() or [f"{role} plan: exit {proc.returncode}"])[-1]
            continue
        parse_plan_lines(out, plans)
    if plans.failure:
        return RolePlans(failure=plans.failure)
    return plans
