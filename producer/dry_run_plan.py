"""`python -m producer plan JOB [--target-config DIR] [--sample-tokens N]`: the target ranks' planned GPU memory
(producer/memory_plan.py) and the target forward's and hand-off's work a batch (producer/throughput_plan.py)
in one process, as tagged JSON lines (common/role_plans.py); launch.sh --dry-run runs it."""

from __future__ import annotations

from common.role_plans import plan_command
from producer.memory_plan import plan_target, read_config
from producer.throughput_plan import target_work

DESCRIPTION = (
    "the target ranks' planned GPU memory and the target forward's and the hand-off's work per batch, in one"
    ' process: one JSON line each, {"memory": ...} then {"work": ...} (launch.sh --dry-run)'
)


def main(argv: list[str]) -> int:
    return plan_command("producer", "plan", argv, DESCRIPTION, read_config, memory=plan_target, work=target_work)
