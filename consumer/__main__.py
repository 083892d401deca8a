"""`python -m consumer --job JOB.toml --drafter NAME --replica R`: one drafter replica's training process."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from common.config import ConfigError, dflash_layer_ids, load_job
from common.profile import ProfileStats
from common.stats import StatsPublisher
from consumer.checkpoint import load_latest, save_checkpoint
from consumer.service import ConsumerService
from consumer.stream import BatchStream
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer

log = logging.getLogger("consumer")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash-consumer", description=__doc__)
    ap.add_argument("--job", required=True, help="the job file (TOML)")
    ap.add_argument("--drafter", required=True, help="drafter name, as in [[drafters]] name")
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--profile-interval", type=float, default=None,
                    help="seconds between stats snapshots (default: telemetry.interval_s; 0 disables)")
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--nnodes", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {args.drafter}.r{args.replica} %(levelname)s %(message)s")
    try:
        job = load_job(args.job)
        cfg = job.drafter(args.drafter)
    except ConfigError as err:
        log.error("%s", err)
        return 2
    if not 0 <= args.replica < cfg.replicas:
        log.error("replica %d is outside drafter %s's %d replicas", args.replica, cfg.name, cfg.replicas)
        return 2
    name = f"{cfg.name}_r{args.replica}"
    device = torch.device(cfg.device_of(args.replica))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(job.job.seed)

    parts = load_target_parts(job.target.path)
    layer_ids = job.target.layer_ids or dflash_layer_ids(parts.num_hidden_layers, job.target.num_features)
    interval = job.telemetry.interval_s if args.profile_interval is None else args.profile_interval
    prof = ProfileStats() if interval > 0 else None
    trainer = Trainer(cfg, parts, layer_ids, device, job_seed=job.job.seed, prof=prof)
    ckpt_root = job.run_paths.checkpoints(cfg.name)
    resumed = load_latest(ckpt_root)
    if resumed is not None:
        trainer.load_state_dict(resumed.state)
        log.info("resumed from %s: step %d, next seq %d", resumed.path, trainer.step, trainer.last_seq + 1)
    trainer.warmup(triton_cache_dir=job.run_paths.root / "triton-cache")

    stats = StatsPublisher(job.run_paths.ipc("telemetry-in.sock"), "consumer", name, interval, prof) if prof else None
    stream = BatchStream(job, cfg.name, args.replica, device, resume_seq=lambda: trainer.last_seq + 1, prof=prof)
    service = ConsumerService(
        trainer, stream, lambda reason: save_checkpoint(ckpt_root, trainer),
        checkpoint_every=cfg.checkpoint_every, idle_timeout_s=job.transport.heartbeat_interval_s,
        prof=prof, stats=stats, name=name,
    )
    log.info("%s on %s (pid %d): %d layers, block %d, target layers %s", name, device, os.getpid(),
             cfg.num_layers, cfg.block_size, layer_ids)
    try:
        return service.run()
    finally:
        if stats:
            stats.close()


if __name__ == "__main__":
    sys.exit(main())
