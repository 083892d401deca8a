"""`python -m consumer plan JOB [--target-config DIR] [--sample-tokens N]`: the drafter replicas' planned GPU
memory (consumer/memory_plan.py) and each drafter's work a batch (consumer/throughput_plan.py) in one
process, as tagged JSON lines (common/role_plans.py); launch.sh --dry-run runs it."""

from __future__ import annotations

from common.role_plans import plan_command
from consumer.memory_plan import plan_drafters, read_config
from consumer.throughput_plan import plan_works

DESCRIPTION = (
    "the drafter replicas' planned GPU memory and each drafter's work per batch on one replica, in one process:"
    ' one JSON line each, {"memory": ...} then {"work": ...} (launch.sh --dry-run)'
)


def main(argv: list[str]) -> int:
    return plan_command("consumer", "plan", argv, DESCRIPTION, read_config, memory=plan_drafters, work=plan_works)
