"""One replica of a two-process gloo group on the CPU that trains the same batch schedule three ways:
replicas without sharding (the DDP-like all-reduce path), FSDP2 straight through, and FSDP2 with a
checkpoint and a resume halfway. Rank 0 saves what the test compares.

    python -m tests.procs.fsdp_worker TARGET_DIR BATCHES.pt OUT_DIR RANK WORLD PORT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from consumer.checkpoint import load_latest, save_checkpoint
from consumer.distributed import GroupEnv, ReplicaGroup, RoundFlags
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from tests.test_drafter_common import LAYER_IDS, drafter_cfg

# per step: the batch indices each rank trains (rank 1 has fewer batches in steps 2 and 3: join semantics)
SCHEDULE = [
    {0: [0], 1: [1]},
    {0: [2, 3], 1: [4]},
    {0: [5], 1: []},
    {0: [6], 1: [7]},
    {0: [0, 1], 1: [2, 3]},
    {0: [4], 1: [5]},
]
RESUME_AT = 3  # steps before the checkpoint in the resumed run


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def main(target: str, batches_path: str, out_dir: str, rank: int, world: int, port: int) -> int:
    torch.manual_seed(0)
    env = GroupEnv(rank, world, rank, 0, 1, "127.0.0.1", port)
    group = ReplicaGroup(env, torch.device("cpu"), timeout_s=300)
    parts = load_target_parts(target)
    batches = torch.load(batches_path, weights_only=True)
    cfg = drafter_cfg(num_layers=2, grad_clip=0.5, warmup_frac=0.2, total_steps=20, distributed="fsdp")
    out = Path(out_dir)

    def trainer(fsdp: bool) -> Trainer:
        t = Trainer(cfg, parts, LAYER_IDS, "cpu")
        if fsdp:
            group.shard(t)
        else:
            group.broadcast_params(t.params)
        t.grad_sync = group.sum_grads
        return t

    def run(t: Trainer, steps: range) -> list[dict]:
        seen = []
        for s in steps:
            for i in SCHEDULE[s][rank]:
                t.accumulate(*batches[i], seq=10 * s + i)
            t.optimizer_step(10 * s + 9)
            params = {n: full(p) for n, p in t.model.named_parameters()}  # collective under FSDP
            seen.append({"params": params, "grad_norm": float(t._grad_norm), "step": t.step})
        return seen

    replicas = run(trainer(False), range(len(SCHEDULE)))
    straight_trainer = trainer(True)
    straight = run(straight_trainer, range(len(SCHEDULE)))
    group.gather_trained([])  # the checkpoint collective: gathers the full state for rank 0
    straight_state = straight_trainer.state_dict() if group.is_writer else None

    first = trainer(True)
    run(first, range(RESUME_AT))
    group.gather_trained([])
    if group.is_writer:
        save_checkpoint(out / "ckpt", first)
    group.sync_round(RoundFlags())  # a barrier: the checkpoint is on disk before anyone resumes
    resumed_trainer = trainer(True)

    def latest():
        ck = load_latest(out / "ckpt")
        return str(ck.path), ck.state

    where, state = group.broadcast_state(latest)
    resumed_trainer.load_state_dict(state, where)
    resumed = run(resumed_trainer, range(RESUME_AT, len(SCHEDULE)))
    group.gather_trained([])
    resumed_state = resumed_trainer.state_dict() if group.is_writer else None
    if group.is_writer:
        torch.save({"replicas": replicas, "straight": straight, "resumed": resumed, "straight_state": straight_state,
                    "resumed_state": resumed_state}, out / "result.pt")
    group.close()
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(a[0], a[1], a[2], int(a[3]), int(a[4]), int(a[5])))
