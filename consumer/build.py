"""The consumer's builders: a validated job (plus drafter, replica group and device) → one drafter replica's
running objects: the trainer resumed from its checkpoint, the streams from every producer, the service.

consumer/__main__.py, bench and tests build through these, so a change to how a consumer is assembled reaches
all three. Stand-ins (a sleeping trainer, a scripted stream) are arguments of `build_service`, not patches.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from common.accounting import LineageError, TrainLedger, ledger_id_of
from common.config import DrafterConfig, JobConfig, dflash_layer_ids
from common.profile import ProfileStats
from common.startup import StartupBeat
from common.stats import StatsSink
from common.storage import StorageError, check_room, check_writable
from consumer.best_checkpoint import BestCheckpoint, settle_best
from consumer.checkpoint import NoIntactCheckpoint, checkpoint_bytes, resume_checkpoint, write_checkpoint
from consumer.checkpoint_state import restore, world_change
from consumer.copy_out import CopyOut, copy_out_rows
from consumer.distributed import GroupEnv, ReplicaGroup, StepTrace
from consumer.export.layout import trainer_export_config
from consumer.fanin import FanIn
from consumer.group_cursor import GroupCursor
from consumer.resume_points import ResumePoints
from consumer.service import ConsumerService, StopSignal
from consumer.shape import ShapeMismatch
from consumer.stream import BatchStream
from consumer.target_parts import TargetParts, TargetPartsError, load_target_parts
from consumer.trainer import NonFiniteCheckpointError, Trainer
from consumer.validation import Evaluator, job_validation
from consumer.warm_start import WarmStartError, warm_start_unless_resuming, with_published_serving_keys

log = logging.getLogger("consumer")

# what loading can fail with because of the job, the disk or the checkpoint: one named line, exit 2
LOAD_ERRORS = (
    TargetPartsError,
    StorageError,
    NoIntactCheckpoint,
    NonFiniteCheckpointError,
    ShapeMismatch,
    LineageError,
    WarmStartError,
)


@dataclass
class Training:
    """A replica's trainer, resumed (or fresh), with where its group's data resumes."""

    trainer: Trainer
    cursor: GroupCursor
    resumed: tuple[str, dict] | None  # (checkpoint path, state) it resumed from
    lineages: list[str]
    layer_ids: list[int]
    checkpoints: Path  # the drafter's checkpoint folder

    def ledger(self, job: JobConfig, cfg: DrafterConfig, env: GroupEnv) -> TrainLedger:
        """The job log of this replica's steps and checkpoints (common/accounting.py), continuing the resumed one."""
        where, state = self.resumed or (None, None)
        return TrainLedger(
            job.run_paths.root,
            cfg.name,
            env.rank,
            env.world_size,
            base_step=self.trainer.step,
            base=ledger_id_of(state) if state else None,
            resumed_from=where,
            lineages=self.lineages,
        )


def target_layer_ids(job: JobConfig, parts: TargetParts) -> list[int]:
    """The job's captured layers; the DFlash default for the target's depth where the job names none."""
    return list(job.target.layer_ids or dflash_layer_ids(parts.num_hidden_layers, job.target.num_features))


def new_trainer(
    job: JobConfig, cfg: DrafterConfig, parts: TargetParts, device: torch.device, prof: ProfileStats | None = None
) -> Trainer:
    """A fresh trainer of drafter `cfg` over the job's captured layers, seeded by the job (a DFlash2 drafter's unset
    serving keys taken from its init_from directory: consumer/warm_start.py)."""
    return Trainer(
        with_published_serving_keys(cfg),
        parts,
        target_layer_ids(job, parts),
        device,
        job_seed=job.job.seed,
        prof=prof,
        tokens_per_batch=job.data.tokens_per_batch,
    )


def load_training(
    job: JobConfig,
    cfg: DrafterConfig,
    env: GroupEnv,
    group: ReplicaGroup,
    device: torch.device,
    prof: ProfileStats | None,
    name: str,
) -> Training:
    """The trainer (FSDP-sharded when asked) resumed from the newest intact checkpoint global rank 0 reads, the
    group cursor, the parameters broadcast; raises one of LOAD_ERRORS, each naming what was wrong."""
    trainer = new_trainer(job, cfg, load_target_parts(job.target.path), device, prof)
    ckpt_root = job.run_paths.checkpoints(cfg.name)
    warm_start_unless_resuming(trainer, ckpt_root)  # init_from: a published drafter's weights, unless resuming
    if cfg.distributed == "fsdp":
        group.shard(trainer)  # FSDP2 over the replicas, before any state is loaded
    what = f"drafter {cfg.name}'s checkpoint folder"
    if group.is_writer:  # a read-only disk is a clear error now, not a traceback at resume
        check_writable(ckpt_root, what)

    def latest():  # on global rank 0, the writer
        ckpt = resume_checkpoint(ckpt_root)  # falls back past broken ones, removes killed writes' leftovers
        settle_best(ckpt_root, ckpt.path if ckpt else None)  # `best` checked as `latest` is
        check_room(ckpt_root, checkpoint_bytes(trainer), what)  # a full disk: now, not a lost checkpoint later
        return None if ckpt is None else (str(ckpt.path), ckpt.state)

    resumed = group.broadcast_state(latest)  # rank 0 reads its disk; the others need no shared filesystem
    where, state = resumed if resumed is not None else ("", None)
    # the shape, weights, lineages and cursor back into their parts: a changed shape is one line, exit 2; a new
    # data.lineage trains a new plan from these weights, from a fresh cursor (common/accounting.py)
    restored = restore(
        state, where, trainer, nnodes=env.nnodes, producers=job.target.replicas, lineage=job.data.lineage
    )
    cursor, lineages = restored.cursor, restored.lineages  # one cursor per producer of each node
    if resumed is not None and not restored.same_plan:
        log.info(
            "resumed the weights of %s (step %d) into data lineage %r (after %s): a new plan from seq 0",
            where,
            trainer.step,
            lineages[-1],
            ", ".join(map(repr, lineages[:-1])),
        )
    elif resumed is not None:
        log.info(
            "resumed from %s: step %d, next seq per producer %s",
            where,
            trainer.step,
            list(cursor.cursors[env.node_rank]),
        )
    changed = world_change(state, where, env.world_size, trainer.fsdp is not None)
    if changed and group.is_writer:
        log.info("%s", changed)
    group.broadcast_params(trainer.params)
    if group.world_size > 1:
        trainer.grad_sync = group.sum_grads
        group.split_muon(trainer.optimizer)
        log.info(
            "%s is rank %d of %d (node %d of %d), group at %s:%d",
            name,
            env.rank,
            env.world_size,
            env.node_rank,
            env.nnodes,
            env.master_addr,
            env.master_port,
        )
    return Training(trainer, cursor, resumed, lineages, trainer.target_layer_ids, ckpt_root)


def build_stream(
    job: JobConfig,
    cfg: DrafterConfig,
    env: GroupEnv,
    device: torch.device,
    resume: ResumePoints,
    stop: StopSignal,
    *,
    prof: ProfileStats | None = None,
    launch_id: str = "",
) -> BatchStream | FanIn:
    """One stream per target replica's producer (consumer/fanin.py), each asking `resume` for its seq, all
    copying out into one CopyOut: the trainer takes one batch at a time, whichever producer sent it."""
    ring = torch.device("cuda" if job.transport_kind == "cuda" else "cpu")
    copy_out = CopyOut(device, ring, copy_out_rows(job))
    streams = [
        BatchStream(
            job,
            cfg.name,
            env.local_rank,
            device,
            resume_seq=lambda p=p: resume.seq(p),
            prof=prof,
            node=env.node_rank,
            launch_id=launch_id,
            stopping=stop.requested,
            producer=p,
            copy_out=copy_out,
        )
        for p in range(job.target.replicas)
    ]
    return streams[0] if len(streams) == 1 else FanIn(streams)


def build_service(
    job: JobConfig,
    cfg: DrafterConfig,
    env: GroupEnv,
    group: ReplicaGroup,
    device: torch.device,
    trainer: Trainer,
    cursor: GroupCursor,
    *,
    stream: BatchStream | FanIn | None = None,
    save=None,
    ledger: TrainLedger | None = None,
    trace: StepTrace | None = None,
    stop: StopSignal | None = None,
    prof: ProfileStats | None = None,
    stats: StatsSink | None = None,
    beat: StartupBeat | None = None,
    name: str | None = None,
    launch_id: str = "",
    evaluator: Evaluator | None = None,
    best: BestCheckpoint | None = None,
) -> ConsumerService:
    """The training loop of one replica over `trainer`, resuming at `cursor`. `stream`: the job's streams
    (None) or a stand-in; `save(state)`: where a checkpoint_state dict goes (None: nowhere, a bench's choice);
    `evaluator`/`best`: the data.validation passes and the best checkpoint (None: passes ignored)."""
    stop = stop or StopSignal()
    resume = ResumePoints(cursor, env.node_rank)
    if stream is None:
        stream = build_stream(job, cfg, env, device, resume, stop, prof=prof, launch_id=launch_id)
    return ConsumerService(
        trainer,
        stream,
        save or _discard,
        group=group,
        resume=resume,
        checkpoint_every=cfg.checkpoint_every,
        idle_timeout_s=job.transport.heartbeat_interval_s,
        prof=prof,
        stats=stats,
        name=name or f"{cfg.name}_r{env.rank}",
        trace=trace,
        ledger=ledger,
        stop=stop,
        beat=beat,
        evaluator=evaluator,
        best=best,
    )


def build_consumer(
    job: JobConfig,
    cfg: DrafterConfig,
    env: GroupEnv,
    group: ReplicaGroup,
    device: torch.device,
    training: Training,
    *,
    stop: StopSignal,
    prof: ProfileStats | None,
    stats: StatsSink | None,
    beat: StartupBeat | None,
    name: str,
    launch_id: str,
    trace_path: str | None,
) -> ConsumerService:
    """Production's service: checkpoints to the drafter's folder, the job log continued, the step trace."""
    root, trainer = training.checkpoints, training.trainer
    evaluator, best = job_validation(job, trainer, group.is_writer, root)  # data.validation passes
    return build_service(
        job,
        cfg,
        env,
        group,
        device,
        trainer,
        training.cursor,
        save=functools.partial(write_checkpoint, root, export=trainer_export_config(trainer)),
        ledger=training.ledger(job, cfg, env),
        evaluator=evaluator,
        best=best,
        trace=StepTrace(trace_path, env.rank, env.node_rank) if trace_path else None,
        stop=stop,
        prof=prof,
        stats=stats,
        beat=beat,
        name=name,
        launch_id=launch_id,
    )


def _discard(state: dict) -> None:
    """No checkpoint: a benchmark's or test's stand-in trainer has nothing worth keeping."""
