"""`python -m consumer --job JOB.toml --drafter NAME --replica R`: one drafter replica's training process.

A drafter with replicas × nnodes > 1 forms a torch.distributed group from MASTER_ADDR / MASTER_PORT (the
launch plan exports them with RANK / WORLD_SIZE / LOCAL_RANK, as torchrun would); see consumer/distributed.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from common.config import ConfigError, load_job
from common.joblock import JobLocked, enter
from common.startup import StartupBeat
from common.stats import open_stats
from common.supervisor import watch_supervisor
from consumer.build import LOAD_ERRORS, build_consumer, load_training
from consumer.distributed import DEFAULT_TIMEOUT_S, GroupEnv, GroupError, ReplicaGroup
from consumer.service import EXIT_GROUP_LOST, StopSignal

log = logging.getLogger("consumer")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["memory-plan"]:  # the drafter replicas' planned GPU memory (consumer/memory_plan.py)
        from consumer.memory_plan import main as memory_plan

        return memory_plan(argv[1:])
    if argv[:1] == ["throughput-plan"]:  # each drafter's work a batch (consumer/throughput_plan.py)
        from consumer.throughput_plan import main as throughput_plan

        return throughput_plan(argv[1:])
    if argv[:1] == ["plan"]:  # both in one process, as JSON lines (consumer/dry_run_plan.py; launch.sh --dry-run)
        from consumer.dry_run_plan import main as plan

        return plan(argv[1:])
    ap = argparse.ArgumentParser(prog="dflash-consumer", description=__doc__)
    ap.add_argument("--job", required=True, help="the job file (TOML)")
    ap.add_argument("--drafter", required=True, help="drafter name, as in [[drafters]] name")
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument(
        "--profile-interval",
        type=float,
        default=None,
        help="seconds between stats snapshots (default: telemetry.interval_s; 0 disables)",
    )
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument(
        "--dist-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds any replica-group collective may wait for the others (default %(default)s)",
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="append one JSON line per optimizer step (seqs, samples, parameter digest) to this file",
    )
    args = ap.parse_args(argv)
    stop = StopSignal()  # from here on SIGTERM/SIGINT/SIGHUP end the process cleanly, start-up included
    watch_supervisor()  # and launch.sh's death (a SIGTERM from the kernel): never an orphan holding the job
    node = f"n{args.node_rank}." if args.nnodes > 1 else ""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {args.drafter}.{node}r{args.replica} %(levelname)s %(message)s",
    )
    try:
        job = load_job(args.job)
        cfg = job.drafter(args.drafter)
    except ConfigError as err:
        log.error("%s", err)
        return 2
    if not 0 <= args.replica < cfg.replicas:
        log.error("replica %d is outside drafter %s's %d replicas", args.replica, cfg.name, cfg.replicas)
        return 2
    try:  # held for life: one job per run folder, one copy of this replica
        lock = enter(job.run_paths.root, f"consumer-{cfg.name}-r{args.replica}", args.node_rank)
    except (JobLocked, OSError) as err:
        log.error("%s", err)
        return 2
    try:
        env = GroupEnv.resolve(
            os.environ, replica=args.replica, replicas=cfg.replicas, node_rank=args.node_rank, nnodes=args.nnodes
        )
    except GroupError as err:
        log.error("%s", err)
        return 2
    name = f"{cfg.name}_r{env.rank}"  # the global rank: unique across nodes, = the replica on one node
    device = torch.device(cfg.device_of(args.replica))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(job.job.seed)

    interval = job.telemetry.interval_s if args.profile_interval is None else args.profile_interval
    prof, stats = open_stats(job.run_paths, "consumer", name, interval)
    try:
        group = ReplicaGroup(env, device, timeout_s=args.dist_timeout, prof=prof)
    except GroupError as err:
        log.error("%s", err)
        if stats:
            stats.close()
        return EXIT_GROUP_LOST
    beat = StartupBeat(stats, log, name)
    try:
        try:
            with beat.phase("loading", f"target parts of {job.target.path}, the drafter, its checkpoint"):
                training = load_training(job, cfg, env, group, device, prof, name)
        except LOAD_ERRORS as err:  # the job, the disk or the checkpoint: one named line
            log.error("%s", err)
            return 2
        with beat.phase("compiling", "kernels and the first-call paths"):
            training.trainer.warmup(triton_cache_dir=job.run_paths.root / "triton-cache")
        if stop.reason:  # stopped while loading: nothing trained, nothing to save
            log.info("%s: %s during start-up; exiting", name, stop.reason)
            return 0
        service = build_consumer(
            job,
            cfg,
            env,
            group,
            device,
            training,
            stop=stop,
            prof=prof,
            stats=stats,
            beat=beat,
            name=name,
            launch_id=lock.launch_id,
            trace_path=args.trace,
        )
        log.info(
            "%s on %s (pid %d): %d layers, block %d, target layers %s",
            name,
            device,
            os.getpid(),
            cfg.num_layers,
            cfg.block_size,
            training.layer_ids,
        )
        return service.run()
    except GroupError as err:
        log.error("%s", err)
        return EXIT_GROUP_LOST
    finally:
        group.close()
        if stats:
            stats.close()


if __name__ == "__main__":
    sys.exit(main())
