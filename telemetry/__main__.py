"""`python -m telemetry --job JOB.toml`: run the telemetry process until SIGTERM/SIGINT/SIGHUP or launch.sh's death."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from common.config import ConfigError, load_job
from common.joblock import JobLocked, enter
from common.supervisor import STOP_SIGNALS, stop_reason, watch_supervisor
from telemetry.service import TelemetryService


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-telemetry", description=__doc__)
    parser.add_argument("--job", required=True, help="job file (TOML)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s telemetry %(levelname)s %(message)s")
    log = logging.getLogger("dflash.telemetry")
    try:
        job = load_job(args.job)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    try:  # held while it runs: one job per run folder, one telemetry per node
        node = int(os.environ.get("NODE_RANK", 0))
        lock = enter(job.run_paths.root, "telemetry", node)
    except (JobLocked, OSError) as err:
        log.error("%s", err)
        return 2
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():

        def on_signal(signum, _frame):
            log.info("%s: flushing the last window", stop_reason(signum))
            stop.set()

        for sig in STOP_SIGNALS:
            signal.signal(sig, on_signal)
        watch_supervisor(log)
    try:
        TelemetryService(job, log, node=node).run(stop)
    finally:
        lock.release()
    log.info("telemetry stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
