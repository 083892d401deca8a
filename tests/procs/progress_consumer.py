"""A consumer stand-in for the progress line: publishes what a training consumer does (steps, tokens, loss
and τ gauges), at a fixed pace, then its final totals, and exits 0.

python -m tests.procs.progress_consumer JOB.toml NAME STEPS STEPS_PER_S
"""

import sys
import time

from common.config import load_job
from common.profile import ProfileStats
from common.stats import StatsPublisher, ingest_endpoint

LOSS, TAU, TOKENS_PER_STEP = 2.5, 3.25, 100


def main(job_path: str, name: str, steps: int, steps_per_s: float) -> int:
    job = load_job(job_path)
    prof = ProfileStats()
    pub = StatsPublisher(ingest_endpoint(job.run_paths), "consumer", name, job.telemetry.interval_s, prof)
    start = time.monotonic()
    for step in range(1, steps + 1):
        time.sleep(max(0.0, start + step / steps_per_s - time.monotonic()))
        prof.count("tokens", TOKENS_PER_STEP)
        prof.count("steps")
        prof.gauge("loss", LOSS)
        prof.gauge("tau_est", TAU)
        pub.maybe_publish(step=step)
    pub.close(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
