"""`make bench`: every benchmark in turn, each in its own process, then one JSON object of all results.

python -m bench.all [--only transport,drafter] [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

BENCHES = ["transport", "producer", "drafter", "telemetry", "pipeline", "scaleout", "topology", "regenerate"]
# What --quick passes to each benchmark: its own short form, or shorter counts where it has no --quick.
QUICK_ARGS = {
    "transport": ["--quick"],
    "producer": ["--batches", "2", "--repeats", "1", "--pipeline-batches", "4"],
    "drafter": ["--quick"],
    "telemetry": ["--rounds", "30"],
    "pipeline": ["--quick"],
    "scaleout": ["--quick"],
    "topology": ["--quick"],
    "regenerate": ["--quick"],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.all", description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(BENCHES))
    ap.add_argument("--quick", action="store_true", help="a short form of each benchmark (see QUICK_ARGS)")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or BENCHES
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        ap.error(f"--only: unknown benchmark(s) {unknown}; choose from {','.join(BENCHES)}")
    results, status = {}, 0
    for name in names:
        cmd = [sys.executable, "-m", f"bench.{name}", "--json"] + (QUICK_ARGS[name] if args.quick else [])
        print(f"=== bench.{name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        lines = proc.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), flush=True)
        try:
            results[name] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": proc.returncode}
        except json.JSONDecodeError:
            results[name] = {"error": "no JSON line"}
        if "error" in results[name]:
            status = 1
        print(f"=== bench.{name}: {time.perf_counter() - start:.0f} s: {json.dumps(results[name])}", flush=True)
    print(json.dumps(results))
    return status


if __name__ == "__main__":
    sys.exit(main())
