"""`python -m producer --job JOB.toml`: the target-forward service.
`python -m producer regenerate ...`: regenerate a dataset's responses with the target (see --help).
`python -m producer data-stats JOB.toml`: what the job's data holds and how many batches and steps it makes.
`python -m producer memory-plan JOB.toml`: the target ranks' planned GPU memory (producer/memory_plan.py).
`python -m producer throughput-plan JOB.toml`: the target forward's and hand-off's work a batch (producer/throughput_plan.py).
`python -m producer plan JOB.toml`: both, in one process, as JSON lines (producer/dry_run_plan.py; launch.sh --dry-run)."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from common.config import ConfigError, load_job
from common.joblock import JobLocked
from common.launch_plan import producer_name
from common.ring import RingError
from common.startup import StartupBeat
from common.stats import open_stats
from common.storage import StorageError
from common.supervisor import watch_supervisor
from producer.build import build_producer, claim_run_folder, load, stop_followers
from producer.data import DataError
from producer.target import TargetLoadError
from producer.tp import TPRank, TPSetupError, follow

log = logging.getLogger("producer")

USER_ERRORS = (ConfigError, StorageError, JobLocked, TargetLoadError, DataError, TPSetupError, RingError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["regenerate"]:
        from producer.regenerate import main as regenerate

        return regenerate(argv[1:])
    if argv[:1] == ["data-stats"]:
        from producer.data_stats import main as data_stats

        return data_stats(argv[1:])
    if argv[:1] == ["memory-plan"]:
        from producer.memory_plan import main as memory_plan

        return memory_plan(argv[1:])
    if argv[:1] == ["throughput-plan"]:
        from producer.throughput_plan import main as throughput_plan

        return throughput_plan(argv[1:])
    if argv[:1] == ["plan"]:
        from producer.dry_run_plan import main as plan

        return plan(argv[1:])
    ap = argparse.ArgumentParser(prog="dflash-producer", description=__doc__)
    ap.add_argument("--job", required=True, help="the job file (TOML)")
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--replica", type=int, default=0, help="which target replica (target.replicas) this producer is")
    ap.add_argument(
        "--profile-interval",
        type=float,
        default=None,
        help="seconds between stats snapshots (default: telemetry.interval_s; 0 disables)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s producer %(levelname)s %(message)s")
    watch_supervisor()  # launch.sh's death becomes a SIGTERM: a graceful stop, never an orphan holding the job
    stats = None
    try:
        job = load_job(args.job)
        if not 0 <= args.replica < job.target.replicas:
            raise ConfigError(
                f"{args.job}: --replica {args.replica} is outside target.replicas ="
                f" {job.target.replicas} (0..{job.target.replicas - 1})"
            )
        tp = TPRank.from_env(job.target.tp_size) if job.target.tp_size > 1 else TPRank(0, 1, 0)
        name = producer_name(args.replica, tp.rank)
        lock = claim_run_folder(job, args.job, name, args.node_rank, copy_job=tp.rank == 0)
        device = job.target.devices_of(args.replica)[tp.rank]
        if device.startswith("cuda"):  # before anything touches CUDA: bare "cuda" tensors, stats and UUIDs are its
            torch.cuda.set_device(device)
        interval = job.telemetry.interval_s if args.profile_interval is None else args.profile_interval
        prof, stats = open_stats(job.run_paths, "producer", name, interval if tp.rank == 0 else 0)
        beat = StartupBeat(stats, log, name)
        with beat.phase("loading", f"target {job.target.path} and the data index"):
            loaded = load(job, node=args.node_rank, nnodes=args.nnodes, replica=args.replica, tp=tp, device=device)
    except USER_ERRORS as err:
        log.error("%s", err)
        if stats:
            stats.close()
        return 2
    if tp.rank > 0:
        log.info("tensor-parallel rank %d of %d on %s: following rank 0", tp.rank, tp.world, device)
        return follow(loaded.target, loaded.tp_group)
    try:
        service = build_producer(
            job,
            loaded,
            node=args.node_rank,
            replica=args.replica,
            device=device,
            launch_id=lock.launch_id,
            prof=prof,
            stats=stats,
            beat=beat,
        )
    except (RingError, RuntimeError, OSError) as err:  # no room in /dev/shm, the job already running, ...
        log.error("%s", err)
        if stats:
            stats.close()
        return 2
    try:
        return service.run()
    finally:
        if stats:
            stats.close()
        stop_followers(service)


if __name__ == "__main__":
    sys.exit(main())
