"""The producer's builders: a validated job (plus node, replica, tensor-parallel rank and device) → its running
objects: the run folder claimed, the ring, the target, the data plan, the service.

producer/__main__.py, bench and tests build through these, so a change to how a producer is assembled reaches
all three. Stand-ins (a sleeping target, a synthetic batch source) are arguments of `build_service`, not patches.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from transformers import AutoConfig

from common.accounting import DeliveryLedger, plan_records
from common.config import JobConfig
from common.joblock import JobLock, enter
from common.profile import ProfileStats
from common.ring import SlotRing
from common.startup import StartupBeat
from common.stats import StatsSink
from common.storage import check_writable
from producer.data import ChatDataset, ChatEncoder, HubSelection, RecordLimits
from producer.fingerprint import check_plan, plan_fingerprint
from producer.plan import BatchPlan
from producer.prefetch import PackedBatch, Prefetcher
from producer.service import ProducerService, create_ring
from producer.target import TargetCapture, load_target
from producer.tokenizer import load_tokenizer
from producer.tp import LeaderTarget, TPGroup, TPRank, distributed_config, ep_shard, init_group
from producer.validation import HeldOut, excluded_ids, job_held_out, split_fingerprint

log = logging.getLogger("producer")

BatchSource = Callable[[int], Iterator[PackedBatch]]  # batches_from(seq): the batches seq, seq + stride, ...


# ---------------------------------------------------------------------------------------------- the process
def claim_run_folder(job: JobConfig, job_file: str | os.PathLike, name: str, node: int, *, copy_job: bool) -> JobLock:
    """The run folder checked writable, this process's lock taken (held for life: one job per run folder),
    its layout made and (`copy_job`: tensor-parallel rank 0 alone) the job file copied in."""
    check_writable(job.run_paths.root, "run folder")
    lock = enter(job.run_paths.root, name, node)
    job.run_paths.make()
    if copy_job and os.path.abspath(job_file) != str(job.run_paths.job_copy.resolve()):
        shutil.copyfile(job_file, job.run_paths.job_copy)
    return lock


# ---------------------------------------------------------------------------------------------- the data
def batch_stream(dataset: ChatDataset, plan: BatchPlan, depth: int, stride: int = 1) -> BatchSource:
    """`batches_from(seq)`: packed batches seq, seq + stride, ... (a target replica's share of the plan),
    tokenized ahead by a background thread."""

    def batches_from(seq: int) -> Iterator[PackedBatch]:
        mine = (b for b in plan.batches_from(seq) if (b.seq - seq) % stride == 0)
        with Prefetcher(dataset, mine, depth=depth) as prefetcher:
            while True:
                try:
                    batch = prefetcher.get(timeout=30.0)
                except TimeoutError:
                    log.warning("the tokenizer thread has not produced a batch for 30 s; still waiting")
                    continue
                if batch is None:
                    return
                yield batch

    return batches_from


def build_dataset(job: JobConfig, node_rank: int, nnodes: int) -> tuple[ChatDataset, BatchPlan]:
    tok_path = job.data.tokenizer or job.target.path
    tokenizer = load_tokenizer(tok_path)  # DataError: no tokenizer files there, named
    start = time.perf_counter()
    encoder = ChatEncoder(tokenizer, job.data.max_length, str(tok_path), job.data.chat_template_kwargs)
    limits = RecordLimits(job.data.max_record_bytes, job.data.record_time_limit_s)
    hub = HubSelection(job.data.split, job.data.subset, job.data.revision)
    dataset = ChatDataset(job.data.path, job.data.format, encoder, limits, hub)
    stats = dataset.stats
    log.info(
        "indexed %s: %d samples, %d tokens, %d truncated, skipped %s (%.1f s)",
        job.data.path,
        len(dataset),
        stats.tokens,
        stats.truncated,
        dict(stats.skipped) or "none",
        time.perf_counter() - start,
    )
    shards = nnodes if job.data.shard_by_node else 1
    plan = BatchPlan(
        dataset.lengths,
        job.job.seed,
        job.data.epochs,
        job.data.tokens_per_batch,
        job.data.length_group_window,
        shard_index=node_rank % shards,
        shard_count=shards,
        exclude=excluded_ids(job.data.validation, len(dataset), job.job.seed),
    )  # held out: never planned
    return dataset, plan


def checked_fingerprint(job: JobConfig, dataset: ChatDataset, node_rank: int, nnodes: int) -> dict:
    """This node's plan fingerprint, checked against the run folder's earlier plans before anything trains
    (producer/fingerprint.py: a changed plan raises PlanChanged naming the change)."""
    start = time.perf_counter()
    d, shards = job.data, nnodes if job.data.shard_by_node else 1
    fingerprint = plan_fingerprint(
        data_path=d.path,
        data_format=d.format,
        tokenizer_dir=d.tokenizer or job.target.path,
        chat_template_kwargs=d.chat_template_kwargs,
        max_length=d.max_length,
        tokens_per_batch=d.tokens_per_batch,
        length_group_window=d.length_group_window,
        seed=job.job.seed,
        shard=(node_rank % shards, shards),
        lengths=dataset.lengths,
        data_files=dataset.files,
        validation=split_fingerprint(d.validation, len(dataset), job.job.seed),
    )
    note = check_plan(plan_records(job.run_paths.root, node_rank), d.lineage, fingerprint, d.epochs, job.run_paths.root)
    log.info("%s (plan fingerprint in %.2f s)", note, time.perf_counter() - start)
    return fingerprint


@dataclass
class DataPlan:
    """A node's indexed dataset, its batch plan, the plan's checked fingerprint and the held-out records
    (data.validation, producer/validation.py; None without)."""

    dataset: ChatDataset
    plan: BatchPlan
    fingerprint: dict
    held_out: HeldOut | None

    def batches_from(self, job: JobConfig) -> BatchSource:
        """This target replica's share of the plan (every `target.replicas`-th batch), tokenized ahead."""
        return batch_stream(self.dataset, self.plan, job.data.prefetch_batches, job.target.replicas)

    def ledger(self, job: JobConfig, node: int) -> DeliveryLedger:
        """The job log every delivered batch of this plan is appended to (common/accounting.py)."""
        plan = self.plan
        return DeliveryLedger(
            job.run_paths.root,
            node,
            len(plan),
            [plan.batches_per_epoch(e) for e in range(plan.epochs)],
            plan.sample_ids.tolist(),
            lineage=job.data.lineage,
            fingerprint=self.fingerprint,
            validation=self.held_out.plan_record() if self.held_out else None,
        )


def load_data(job: JobConfig, node: int, nnodes: int) -> DataPlan:
    dataset, plan = build_dataset(job, node, nnodes)
    fingerprint = checked_fingerprint(job, dataset, node, nnodes)
    return DataPlan(dataset, plan, fingerprint, job_held_out(job, dataset))


# ---------------------------------------------------------------------------------------------- the target
def ring_before_target(job: JobConfig, node: int, replica: int) -> SlotRing | None:
    """The ring sized from the target's config.json, made before the target loads (producer/service.py
    `create_ring` says why); None when the config cannot be read (load_target then names the problem)."""
    try:
        hidden = int(AutoConfig.from_pretrained(job.target.path, local_files_only=True).get_text_config().hidden_size)
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    n = len(job.target.layer_ids) if job.target.layer_ids else job.target.num_features
    return create_ring(job, replica, job.ring_name(node, replica), n * hidden, job.slot_feature_dtype)


def load_job_target(job: JobConfig, device: str) -> TargetCapture:
    """The job's target on `device`, cut to its captured layers (tensor/expert parallel as the job says)."""
    t = job.target
    return load_target(
        t.path, t.layer_ids, t.num_features, t.dtype, device, t.attn_implementation, distributed_config(t)
    )


@dataclass
class Loaded:
    """What the loading phase made: the target on every rank; the ring and the data plan on rank 0 alone."""

    target: TargetCapture
    ring: SlotRing | None
    data: DataPlan | None
    tp_group: TPGroup | None


def load(job: JobConfig, *, node: int, nnodes: int, replica: int, tp: TPRank, device: str) -> Loaded:
    """The ring (rank 0, before the target: a CUDA ring must be the first allocation on its GPU), the target,
    then (rank 0) the data plan. A failure closes the ring it made and raises the loader's named error."""
    tp_group = init_group(device, max(60.0, 6 * job.transport.heartbeat_timeout_s)) if tp.world > 1 else None
    ring = ring_before_target(job, node, replica) if tp.rank == 0 else None
    try:
        target = load_job_target(job, device)
        if job.target.ep_size > 1:
            log.info("rank %d: %s", tp.rank, ep_shard(target.model, job.target))
        data = load_data(job, node, nnodes) if tp.rank == 0 else None
        if tp_group is not None and tp.rank == 0:
            tp_group.started()  # the followers wait for this before their first command
    except BaseException:
        if ring is not None:
            ring.close()
        raise
    return Loaded(target, ring, data, tp_group)


# ---------------------------------------------------------------------------------------------- the service
def build_service(
    job: JobConfig,
    target: TargetCapture,
    batches_from: BatchSource,
    total_batches: int,
    *,
    node: int = 0,
    replica: int = 0,
    ring: SlotRing | None = None,
    ledger: DeliveryLedger | None = None,
    launch_id: str = "",
    prof: ProfileStats | None = None,
    stats: StatsSink | None = None,
    beat: StartupBeat | None = None,
    held_out: HeldOut | None = None,
) -> ProducerService:
    """The producer loop of target replica `replica` on node `node`, serving `batches_from` through the job's
    ring name. Production passes the loaded target and the data plan; bench and tests pass stand-ins.
    `held_out`: the validation passes this producer runs (producer 0 of node 0 alone)."""
    return ProducerService(
        job,
        target,
        batches_from,
        total_batches,
        ring_name=job.ring_name(node, replica),
        ring=ring,
        prof=prof,
        stats=stats,
        ledger=ledger,
        launch_id=launch_id,
        node=node,
        replica=replica,
        beat=beat,
        held_out=held_out,
    )


def build_producer(
    job: JobConfig,
    loaded: Loaded,
    *,
    node: int,
    replica: int,
    device: str,
    launch_id: str,
    prof: ProfileStats | None,
    stats: StatsSink | None,
    beat: StartupBeat | None,
) -> ProducerService:
    """Rank 0's service over what `load` made (a tensor-parallel leader drives its followers through the
    target). On failure the ring is closed and the followers are stopped before the error propagates."""
    target, data = loaded.target, loaded.data
    assert data is not None, "build_producer is rank 0's: the followers run producer.tp.follow"
    log.info(
        "target %s: %d of %d layers run, features %s × %d = %d wide, %s on %s",
        job.target.path,
        target.layers_run,
        target.num_target_layers,
        target.layer_ids,
        target.hidden_size,
        target.feature_width,
        job.target.dtype,
        device,
    )
    target.prof = prof  # counts the batches that run one forward per sequence
    if loaded.tp_group is not None:
        target = LeaderTarget(target, loaded.tp_group.control, keepalive_s=job.transport.heartbeat_interval_s)
    try:
        return build_service(
            job,
            target,
            data.batches_from(job),
            len(data.plan),
            node=node,
            replica=replica,
            ring=loaded.ring,
            ledger=data.ledger(job, node),
            launch_id=launch_id,
            prof=prof,
            stats=stats,
            beat=beat,
            held_out=data.held_out if (node, replica) == (0, 0) else None,
        )
    except BaseException:
        if loaded.ring is not None:
            loaded.ring.close()  # the service closes it on its own failures; closing twice is harmless
        if isinstance(target, LeaderTarget):
            target.stop()
        raise


def stop_followers(service: ProducerService) -> None:
    """A tensor-parallel leader's followers are told to exit when its service ends."""
    if isinstance(service.target, LeaderTarget):
        service.target.stop()
