"""`python -m consumer --job JOB.toml --drafter NAME --replica R`: one drafter replica's training process.

A drafter with replicas × nnodes > 1 forms a torch.distributed group from MASTER_ADDR / MASTER_PORT (the
launch plan exports them with RANK / WORLD_SIZE / LOCAL_RANK, as torchrun would); see consumer/distributed.py.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys

import torch

from common.accounting import LineageError, TrainLedger, ledger_id_of
from common.config import ConfigError, dflash_layer_ids, load_job
from common.joblock import JobLocked, enter
from common.profile import ProfileStats
from common.startup import StartupBeat
from common.stats import StatsPublisher
from common.storage import StorageError, check_room
from common.supervisor import watch_supervisor
from consumer.checkpoint import NoIntactCheckpoint, checkpoint_bytes, resume_checkpoint, write_checkpoint
from consumer.checkpoint_state import restore
from consumer.distributed import DEFAULT_TIMEOUT_S, GroupEnv, GroupError, ReplicaGroup, StepTrace
from consumer.export.layout import trainer_export_config
from consumer.fanin import FanIn
from consumer.service import EXIT_GROUP_LOST, ConsumerService, StopSignal
from consumer.shape import ShapeMismatch
from consumer.stream import BatchStream
from consumer.target_parts import TargetPartsError, load_target_parts
from consumer.trainer import NonFiniteCheckpointError, Trainer
from consumer.validation import job_validation
from consumer.warm_start import WarmStartError, warm_start_unless_resuming

log = logging.getLogger("consumer")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["memory-plan"]:  # the drafter replicas' planned GPU memory (consumer/memory_plan.py)
        from consumer.memory_plan import main as memory_plan

        return memory_plan(argv[1:])
    ap = argparse.ArgumentParser(prog="dflash-consumer", description=__doc__)
    ap.add_argument("--job", required=True, help="the job file (TOML)")
    ap.add_argument("--drafter", required=True, help="drafter name, as in [[drafters]] name")
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--profile-interval", type=float, default=None,
                    help="seconds between stats snapshots (default: telemetry.interval_s; 0 disables)")
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--dist-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="seconds any replica-group collective may wait for the others (default %(default)s)")
    ap.add_argument("--trace", default=None,
                    help="append one JSON line per optimizer step (seqs, samples, parameter digest) to this file")
    args = ap.parse_args(argv)
    stop = StopSignal()  # from here on SIGTERM/SIGINT/SIGHUP end the process cleanly, start-up included
    watch_supervisor()  # and launch.sh's death (a SIGTERM from the kernel): never an orphan holding the job
    node = f"n{args.node_rank}." if args.nnodes > 1 else ""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {args.drafter}.{node}r{args.replica} %(levelname)s %(message)s")
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
        env = GroupEnv.resolve(os.environ, replica=args.replica, replicas=cfg.replicas, node_rank=args.node_rank,
                               nnodes=args.nnodes)
    except GroupError as err:
        log.error("%s", err)
        return 2
    name = f"{cfg.name}_r{env.rank}"  # the global rank: unique across nodes, = the replica on one node
    device = torch.device(cfg.device_of(args.replica))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(job.job.seed)

    interval = job.telemetry.interval_s if args.profile_interval is None else args.profile_interval
    prof = ProfileStats() if interval > 0 else None
    try:
        group = ReplicaGroup(env, device, timeout_s=args.dist_timeout, prof=prof)
    except GroupError as err:
        log.error("%s", err)
        return EXIT_GROUP_LOST
    try:
        return run(job, cfg, env, group, device, prof, interval, name, args.trace, stop, lock.launch_id)
    except GroupError as err:
        log.error("%s", err)
        return EXIT_GROUP_LOST
    finally:
        group.close()


def run(job, cfg, env: GroupEnv, group: ReplicaGroup, device: torch.device, prof: ProfileStats | None,
        interval: float, name: str, trace_path: str | None, stop: StopSignal, launch_id: str) -> int:
    # published from the start, so that loading and compiling show as phases, not as a silent process
    stats = StatsPublisher(job.run_paths.ipc("telemetry-in.sock"), "consumer", name, interval, prof) if prof else None
    try:
        return _run(job, cfg, env, group, device, prof, name, trace_path, stop, launch_id, stats,
                    StartupBeat(stats, log, name))  # fmt: skip
    finally:
        if stats:
            stats.close()


def _run(job, cfg, env: GroupEnv, group: ReplicaGroup, device: torch.device, prof: ProfileStats | None, name: str,
         trace_path: str | None, stop: StopSignal, launch_id: str, stats, beat: StartupBeat) -> int:
    with beat.phase("loading", f"target parts of {job.target.path}, the drafter, its checkpoint"):
        status = _load(job, cfg, env, group, device, prof, name)
    if isinstance(status, int):
        return status
    trainer, cursor, resumed, lineages, layer_ids, ckpt_root = status
    with beat.phase("compiling", "kernels and the first-call paths"):
        trainer.warmup(triton_cache_dir=job.run_paths.root / "triton-cache")
    if stop.reason:  # stopped while loading: nothing trained, nothing to save
        log.info("%s: %s during start-up; exiting", name, stop.reason)
        return 0
    return _serve(job, cfg, env, group, device, prof, name, trace_path, stop, launch_id, stats, beat,
                  trainer, cursor, resumed, lineages, layer_ids, ckpt_root)  # fmt: skip


def _load(job, cfg, env: GroupEnv, group: ReplicaGroup, device: torch.device, prof: ProfileStats | None, name: str):
    """(trainer, cursor, resumed, lineages, layer_ids, checkpoint root), or an exit status."""
    try:
        parts = load_target_parts(job.target.path)
    except TargetPartsError as err:
        log.error("%s", err)
        return 2
    layer_ids = job.target.layer_ids or dflash_layer_ids(parts.num_hidden_layers, job.target.num_features)
    trainer = Trainer(cfg, parts, layer_ids, device, job_seed=job.job.seed, prof=prof,
                      tokens_per_batch=job.data.tokens_per_batch)
    try:  # init_from: weights of a published drafter, unless this drafter has a checkpoint to resume
        warm_start_unless_resuming(trainer, job.run_paths.checkpoints(cfg.name))
    except WarmStartError as err:
        log.error("%s", err)
        return 2
    if cfg.distributed == "fsdp":
        group.shard(trainer)  # FSDP2 over the replicas, before any state is loaded
    ckpt_root = job.run_paths.checkpoints(cfg.name)
    if group.is_writer:  # a read-only or full disk is a clear error now, not a lost checkpoint hours later
        try:
            check_room(ckpt_root, checkpoint_bytes(trainer), f"drafter {cfg.name}'s checkpoint folder")
        except StorageError as err:
            log.error("%s", err)
            return 2

    def latest():
        ckpt = resume_checkpoint(ckpt_root)  # falls back past broken ones, saying so
        return None if ckpt is None else (str(ckpt.path), ckpt.state)

    try:
        resumed = group.broadcast_state(latest)  # rank 0 reads its disk; the others need no shared filesystem
        where, state = resumed if resumed is not None else ("", None)
        # the shape, weights, lineages and cursor back into their parts: a changed shape is one line, exit 2
        restored = restore(state, where, trainer, nnodes=env.nnodes, producers=job.target.replicas,
                           lineage=job.data.lineage)
    except (NoIntactCheckpoint, NonFiniteCheckpointError, ShapeMismatch, LineageError) as err:
        log.error("%s", err)
        return 2
    cursor, lineages = restored.cursor, restored.lineages  # one cursor per producer of each node
    if resumed is not None and not restored.same_plan:
        log.info("resumed the weights of %s (step %d) into data lineage %r (after %s): a new plan from seq 0",
                 where, trainer.step, lineages[-1], ", ".join(map(repr, lineages[:-1])))
    elif resumed is not None:
        log.info("resumed from %s: step %d, next seq per producer %s", where, trainer.step,
                 list(cursor.cursors[env.node_rank]))
    group.broadcast_params(trainer.params)
    if group.world_size > 1:
        trainer.grad_sync = group.sum_grads
        log.info("%s is rank %d of %d (node %d of %d), group at %s:%d", name, env.rank, env.world_size,
                 env.node_rank, env.nnodes, env.master_addr, env.master_port)
    return trainer, cursor, resumed, lineages, layer_ids, ckpt_root


def _serve(job, cfg, env: GroupEnv, group: ReplicaGroup, device: torch.device, prof: ProfileStats | None, name: str,
           trace_path: str | None, stop: StopSignal, launch_id: str, stats, beat: StartupBeat,
           trainer, cursor, resumed, lineages, layer_ids, ckpt_root) -> int:
    # the stream asks for the resume seq on every (re)attachment: the service knows it (bound late)
    # one stream per target replica's producer (consumer/fanin.py); each asks for its own resume seq
    producers = job.target.replicas
    streams = [BatchStream(job, cfg.name, env.local_rank, device, resume_seq=lambda p=p: service.resume_seq(p),
                           prof=prof, node=env.node_rank, launch_id=launch_id,
                           stopping=lambda: stop.reason is not None, producer=p) for p in range(producers)]
    stream = streams[0] if producers == 1 else FanIn(streams)
    evaluator, best = job_validation(job, trainer, group.world_size, ckpt_root)  # data.validation passes
    service = ConsumerService(
        trainer, stream, functools.partial(write_checkpoint, ckpt_root, export=trainer_export_config(trainer)),
        group=group, cursor=cursor, checkpoint_every=cfg.checkpoint_every,
        idle_timeout_s=job.transport.heartbeat_interval_s, prof=prof, stats=stats, name=name,
        trace=StepTrace(trace_path, env.rank, env.node_rank) if trace_path else None,
        ledger=TrainLedger(job.run_paths.root, cfg.name, env.rank, env.world_size, base_step=trainer.step,
                           base=ledger_id_of(resumed[1]) if resumed else None,
                           resumed_from=resumed[0] if resumed else None, lineages=lineages),
        stop=stop, beat=beat, evaluator=evaluator, best=best,
    )
    log.info("%s on %s (pid %d): %d layers, block %d, target layers %s", name, device, os.getpid(),
             cfg.num_layers, cfg.block_size, layer_ids)
    return service.run()

if __name__ == "__main__":
    sys.exit(main())
