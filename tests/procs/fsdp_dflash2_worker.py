"""One replica of a two-process gloo group on the CPU training a DFlash2 (or DSpark) drafter on the same batch
schedule twice: unsharded replicas (the all-reduce path) and FSDP2 (decoder layers with their convolutions, and the
candidate selector, as units of their own; DSpark's heads stay in the root). Rank 0 saves what
tests/consumer/test_recipe_dflash2.py (and test_recipe_dspark.py) compares.

    python -m tests.procs.fsdp_dflash2_worker TARGET_DIR BATCHES.pt OUT_DIR RANK WORLD PORT [ARCH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from consumer.distributed import GroupEnv, ReplicaGroup
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from tests.consumer.test_drafter_common import LAYER_IDS, drafter_cfg
from tests.procs.fsdp_worker import full

# per step: the batch indices each rank trains (rank 1 has none in step 2: join semantics, stand-in passes)
SCHEDULE = [{0: [0], 1: [1]}, {0: [2, 3], 1: []}, {0: [1], 1: [3]}]


def main(target: str, batches_path: str, out_dir: str, rank: int, world: int, port: int, arch: str = "dflash2") -> int:
    torch.manual_seed(0)
    group = ReplicaGroup(GroupEnv(rank, world, rank, 0, 1, "127.0.0.1", port), torch.device("cpu"), timeout_s=300)
    parts = load_target_parts(target)
    batches = torch.load(batches_path, weights_only=True)
    cfg = drafter_cfg(
        arch=arch,
        num_layers=2,
        selector_rank=8,
        selector_top_k=4,
        markov_rank=8,
        grad_clip=0.5,
        total_steps=20,
        distributed="fsdp",
    )

    def run(fsdp: bool) -> list[dict]:
        t = Trainer(cfg, parts, LAYER_IDS, "cpu")
        if fsdp:
            group.shard(t)
        else:
            group.broadcast_params(t.params)
        t.grad_sync = group.sum_grads
        seen = []
        for s, plan in enumerate(SCHEDULE):
            for i in plan[rank]:
                t.accumulate(*batches[i], seq=10 * s + i)
            logged = t.optimizer_step(10 * s + 9)
            params = {n: full(p) for n, p in t.model.named_parameters()}  # collective under FSDP
            seen.append(
                {
                    "params": params,
                    "grad_norm": float(t._grad_norm),
                    "step": t.step,
                    "selector_recall": logged.get("selector_recall", float("nan")) if logged else float("nan"),
                    "loss": logged["loss"] if logged else float("nan"),
                }
            )
        return seen

    result = {"replicas": run(False), "fsdp": run(True)}
    if rank == 0:
        torch.save(result, Path(out_dir) / "result.pt")
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(
        main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), *sys.argv[7:])
    )
