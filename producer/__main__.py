"""`python -m producer --job JOB.toml`: the target-forward service.
`python -m producer regenerate ...`: regenerate a dataset's responses with the target (see --help).
`python -m producer data-stats JOB.toml`: what the job's data holds and how many batches and steps it makes.
`python -m producer memory-plan JOB.toml`: the target ranks' planned GPU memory (producer/memory_plan.py)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator

import torch
from transformers import AutoConfig

from common.accounting import DeliveryLedger, plan_records
from common.config import ConfigError, JobConfig, load_job
from common.joblock import JobLocked, enter
from common.launch_plan import producer_name
from common.profile import ProfileStats
from common.ring import RingError, SlotRing
from common.startup import StartupBeat
from common.stats import StatsPublisher
from common.storage import StorageError, check_writable
from common.supervisor import watch_supervisor
from producer.data import ChatDataset, ChatEncoder, DataError, HubSelection, RecordLimits
from producer.fingerprint import check_plan, plan_fingerprint
from producer.plan import BatchPlan
from producer.prefetch import PackedBatch, Prefetcher
from producer.service import ProducerService, create_ring
from producer.target import TargetLoadError, load_target
from producer.tokenizer import load_tokenizer
from producer.tp import LeaderTarget, TPRank, TPSetupError, distributed_config, ep_shard, follow, init_group
from producer.validation import excluded_ids, job_held_out, split_fingerprint

log = logging.getLogger("producer")


def batch_stream(dataset: ChatDataset, plan: BatchPlan, depth: int, stride: int = 1) -> Callable[[int], Iterator[PackedBatch]]:
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


def ring_before_target(job: JobConfig, node: int, replica: int) -> SlotRing | None:
    """The ring sized from the target's config.json, made before the target loads (producer/service.py
    `create_ring` says why); None when the config cannot be read (load_target then names the problem)."""
    try:
        hidden = int(AutoConfig.from_pretrained(job.target.path, local_files_only=True).get_text_config().hidden_size)
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    n = len(job.target.layer_ids) if job.target.layer_ids else job.target.num_features
    return create_ring(job, replica, job.ring_name(node, replica), n * hidden, job.target.dtype)


def build_dataset(job: JobConfig, node_rank: int, nnodes: int) -> tuple[ChatDataset, BatchPlan]:
    tok_path = job.data.tokenizer or job.target.path
    tokenizer = load_tokenizer(tok_path)  # DataError: no tokenizer files there, named
    start = time.perf_counter()
    encoder = ChatEncoder(tokenizer, job.data.max_length, str(tok_path), job.data.chat_template_kwargs)
    limits = RecordLimits(job.data.max_record_bytes, job.data.record_time_limit_s)
    hub = HubSelection(job.data.split, job.data.subset, job.data.revision)
    dataset = ChatDataset(job.data.path, job.data.format, encoder, limits, hub)
    stats = dataset.stats
    log.info("indexed %s: %d samples, %d tokens, %d truncated, skipped %s (%.1f s)", job.data.path, len(dataset),
             stats.tokens, stats.truncated, dict(stats.skipped) or "none", time.perf_counter() - start)
    shards = nnodes if job.data.shard_by_node else 1
    plan = BatchPlan(dataset.lengths, job.job.seed, job.data.epochs, job.data.tokens_per_batch,
                     job.data.length_group_window, shard_index=node_rank % shards, shard_count=shards,
                     exclude=excluded_ids(job.data.validation, len(dataset), job.job.seed))  # held out: never planned
    return dataset, plan


def checked_fingerprint(job: JobConfig, dataset: ChatDataset, node_rank: int, nnodes: int) -> dict:
    """This node's plan fingerprint, checked against the run folder's earlier plans before anything trains
    (producer/fingerprint.py: a changed plan raises PlanChanged naming the change)."""
    start = time.perf_counter()
    d, shards = job.data, nnodes if job.data.shard_by_node else 1
    fingerprint = plan_fingerprint(
        data_path=d.path, data_format=d.format, tokenizer_dir=d.tokenizer or job.target.path,
        chat_template_kwargs=d.chat_template_kwargs, max_length=d.max_length, tokens_per_batch=d.tokens_per_batch,
        length_group_window=d.length_group_window, seed=job.job.seed, shard=(node_rank % shards, shards),
        lengths=dataset.lengths, data_files=dataset.files,
        validation=split_fingerprint(d.validation, len(dataset), job.job.seed))
    note = check_plan(plan_records(job.run_paths.root, node_rank), d.lineage, fingerprint, d.epochs, job.run_paths.root)
    log.info("%s (plan fingerprint in %.2f s)", note, time.perf_counter() - start)
    return fingerprint


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
    ap = argparse.ArgumentParser(prog="dflash-producer", description=__doc__)
    ap.add_argument("--job", required=True, help="the job file (TOML)")
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--replica", type=int, default=0, help="which target replica (target.replicas) this producer is")
    ap.add_argument("--profile-interval", type=float, default=None,
                    help="seconds between stats snapshots (default: telemetry.interval_s; 0 disables)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s producer %(levelname)s %(message)s")
    watch_supervisor()  # launch.sh's death becomes a SIGTERM: a graceful stop, never an orphan holding the job
    tp_group = None  # tensor parallelism (producer/tp.py): the group's command channels
    ring = None
    stats = None
    try:
        job = load_job(args.job)
        if not 0 <= args.replica < job.target.replicas:
            raise ConfigError(f"{args.job}: --replica {args.replica} is outside target.replicas ="
                              f" {job.target.replicas} (0..{job.target.replicas - 1})")
        tp = TPRank.from_env(job.target.tp_size) if job.target.tp_size > 1 else TPRank(0, 1, 0)
        check_writable(job.run_paths.root, "run folder")
        name = producer_name(args.replica, tp.rank)
        lock = enter(job.run_paths.root, name, args.node_rank)  # held for life: one job per run folder
        job.run_paths.make()
        if tp.rank == 0 and os.path.abspath(args.job) != str(job.run_paths.job_copy.resolve()):
            shutil.copyfile(args.job, job.run_paths.job_copy)
        device = job.target.devices_of(args.replica)[tp.rank]
        if device.startswith("cuda"):  # before anything touches CUDA: bare "cuda" tensors, stats and UUIDs are its
            torch.cuda.set_device(device)
        interval = job.telemetry.interval_s if args.profile_interval is None else args.profile_interval
        prof = ProfileStats() if interval > 0 and tp.rank == 0 else None
        # published from the start, so that loading shows as a phase, not as a silent process
        stats = StatsPublisher(job.run_paths.ipc("telemetry-in.sock"), "producer", name, interval, prof) if prof else None
        beat = StartupBeat(stats, log, name)
        with beat.phase("loading", f"target {job.target.path} and the data index"):
            if tp.world > 1:
                tp_group = init_group(device, max(60.0, 6 * job.transport.heartbeat_timeout_s))
            if tp.rank == 0:
                ring = ring_before_target(job, args.node_rank, args.replica)
            target = load_target(job.target.path, job.target.layer_ids, job.target.num_features, job.target.dtype,
                                 device, job.target.attn_implementation, distributed_config(job.target))
            if job.target.ep_size > 1:
                log.info("rank %d: %s", tp.rank, ep_shard(target.model, job.target))
            if tp.rank == 0:
                dataset, plan = build_dataset(job, args.node_rank, args.nnodes)
                fingerprint = checked_fingerprint(job, dataset, args.node_rank, args.nnodes)
                held_out = job_held_out(job, dataset)  # data.validation (producer/validation.py)
                if tp_group is not None:
                    tp_group.started()  # the followers wait for this before their first command
    except (ConfigError, StorageError, JobLocked, TargetLoadError, DataError, TPSetupError, RingError) as err:
        log.error("%s", err)
        if ring is not None:
            ring.close()
        if stats:
            stats.close()
        return 2
    if tp.rank > 0:
        log.info("tensor-parallel rank %d of %d on %s: following rank 0", tp.rank, tp.world, device)
        return follow(target, tp_group)
    log.info("target %s: %d of %d layers run, features %s × %d = %d wide, %s on %s", job.target.path,
             target.layers_run, target.num_target_layers, target.layer_ids, target.hidden_size,
             target.feature_width, job.target.dtype, device)

    target.prof = prof  # counts the batches that run one forward per sequence
    if tp_group is not None:
        target = LeaderTarget(target, tp_group.control, keepalive_s=job.transport.heartbeat_interval_s)
    try:
        ledger = DeliveryLedger(job.run_paths.root, args.node_rank, len(plan),
                                [plan.batches_per_epoch(e) for e in range(plan.epochs)], plan.sample_ids.tolist(),
                                lineage=job.data.lineage, fingerprint=fingerprint,
                                validation=held_out.plan_record() if held_out else None)
        service = ProducerService(
            job, target, batch_stream(dataset, plan, job.data.prefetch_batches, job.target.replicas), len(plan),
            ring_name=job.ring_name(args.node_rank, args.replica), ring=ring,
            prof=prof, stats=stats, ledger=ledger, launch_id=lock.launch_id, node=args.node_rank, replica=args.replica,
            beat=beat, held_out=held_out if (args.node_rank, args.replica) == (0, 0) else None,
        )
    except (RingError, RuntimeError, OSError) as err:  # no room in /dev/shm, the job already running, ...
        log.error("%s", err)
        if ring is not None:
            ring.close()  # the service closes it on its own failures; closing twice is harmless
        if stats:
            stats.close()
        if isinstance(target, LeaderTarget):
            target.stop()
        return 2
    try:
        return service.run()
    finally:
        if stats:
            stats.close()
        if isinstance(target, LeaderTarget):
            target.stop()


if __name__ == "__main__":
    sys.exit(main())
