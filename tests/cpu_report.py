"""`python -m tests.cpu_report FILE [N]`: the N test files (default 25) that cost the most CPU in a suite run
written with `pytest --cpu-log FILE`, their tests' wall seconds beside it, and the run's totals: where the
suite's time goes (pytest's --durations gives wall time alone, which under xdist hides what a test's
processes cost the other worker)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def per_file(lines: list[str]) -> dict[str, list[float]]:
    """test file → [tests, wall, cpu of the test process, cpu of the processes it started]."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            key = row["test"].split("::")[0]
            out[key][0] += 1
            out[key][1] += row["wall"]
            out[key][2] += row["cpu_self"]
            out[key][3] += row["cpu_children"]
        except (ValueError, KeyError, TypeError) as err:
            raise SystemExit(f"cpu_report: line {n} is not a --cpu-log record ({err!r}): {line[:120]!r}") from None
    return out


def main(argv: list[str]) -> int:
    if not argv or not Path(argv[0]).is_file():
        print("usage: python -m tests.cpu_report FILE [N]  (FILE: written by pytest --cpu-log FILE)", file=sys.stderr)
        return 2
    files = per_file(Path(argv[0]).read_text().splitlines())
    top = int(argv[1]) if len(argv) > 1 else 25
    cpu = {k: v[2] + v[3] for k, v in files.items()}
    total = sum(cpu.values())
    if not files:
        print(f"cpu_report: {argv[0]} holds no test", file=sys.stderr)
        return 2
    print(f"{'cpu s':>8} {'share':>6} {'wall s':>8} {'tests':>5}  file (cpu: the test process + what it started)")
    for key in sorted(cpu, key=cpu.get, reverse=True)[:top]:
        tests, wall, _, _ = files[key]
        print(f"{cpu[key]:8.1f} {cpu[key] / total:6.1%} {wall:8.1f} {int(tests):5d}  {key}")
    tests = sum(int(v[0]) for v in files.values())
    print(f"{total:8.1f} {'100%':>6} {sum(v[1] for v in files.values()):8.1f} {tests:5d}  all {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
