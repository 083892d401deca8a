"""One replica of a two-process gloo group on the CPU running the real consumer loop (consumer/build.py's
load_training and build_service) over a scripted stream, with data.validation on: the passes reach rank 1
only (as the producer sends each to one replica), rank 0 is the checkpoint writer. Run once unsharded
(`ddp`), under `distributed = "fsdp"`, and under FSDP with a step every two rounds, in the same group. Rank 1 saves the passes it evaluated.

    python -m tests.procs.validation_group_worker TARGET_DIR BATCHES.pt OUT_DIR RANK WORLD PORT
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from common.config import parse_job
from consumer.build import build_service, load_training
from consumer.checkpoint import write_checkpoint
from consumer.distributed import GroupEnv, ReplicaGroup
from consumer.export.layout import trainer_export_config
from consumer.service import EXIT_OK
from consumer.stream import ReceivedBatch, StreamEnd
from consumer.validation import job_validation
from tests.consumer.test_consumer_service import ScriptedStream
from tests.consumer.test_drafter_common import LAYER_IDS, drafter_cfg

PASS = ["v0", "v1"]  # a pass is two validation batches
STEPS, PASS_AFTER = 12, (2, 5, 7, 9, 12)  # rank 1 holds a pass after its batches of these rounds
# per rank, the items its stream hands out: training batches (by index), validation passes, then END
SCRIPT = {
    0: [0] * STEPS,
    1: [e for step in range(1, STEPS + 1) for e in ([1, PASS] if step in PASS_AFTER else [1])],
}


def items(rank: int, batches: dict) -> list:
    out, passes = [], 0
    for entry in SCRIPT[rank]:
        if entry is PASS:
            passes += 1
            for index, name in enumerate(PASS):
                hidden, ids, mask, cu = batches[name]
                val = (passes, index, len(PASS))
                out.append(ReceivedBatch(-2 - index, 0, [100 + index], ids, mask, cu, hidden=hidden, validation=val))
        else:
            hidden, ids, mask, cu = batches["train"][entry]
            out.append(ReceivedBatch(len(out) * 2 + rank, 0, [entry], ids, mask, cu, hidden=hidden))
    return [*out, StreamEnd("end of data", -1)]


def main(target: str, batches_path: str, out_dir: str, rank: int, world: int, port: int) -> int:
    env = GroupEnv(rank, world, rank, 0, 1, "127.0.0.1", port)
    group = ReplicaGroup(env, torch.device("cpu"), timeout_s=300)
    batches = torch.load(batches_path, weights_only=True)
    evaluated = {}
    round_tokens = sum(batches["train"][i][1].numel() for i in (0, 1))  # rank 0's batch and rank 1's
    # fsdp_accum: a step every two rounds, so passes (and a best's save) fall inside an open, deferred step
    modes = {"ddp": ("ddp", 0), "fsdp": ("fsdp", 0), "fsdp_accum": ("fsdp", 2 * round_tokens)}
    for mode, (distributed, tokens_per_step) in modes.items():
        cfg = drafter_cfg(
            num_layers=2,
            anchors_per_seq=32,
            distributed=distributed,
            tokens_per_step=tokens_per_step,
            checkpoint_every=1000,
        )
        job = parse_job(
            {
                "job": {"run_dir": str(Path(out_dir) / mode), "seed": 0},
                "target": {"path": target, "layer_ids": LAYER_IDS},
                "data": {"path": "unused.jsonl", "validation": 0.1, "eval_every": 2},
                "drafters": [cfg.model_dump()],
                "transport": {"heartbeat_interval_s": 60.0, "heartbeat_timeout_s": 120.0},  # nobody starves
            }
        )
        cfg = job.drafters[0]
        device = torch.device("cpu")
        training = load_training(job, cfg, env, group, device, None, f"d0_r{rank}")
        trainer, root = training.trainer, training.checkpoints
        evaluator, best = job_validation(job, trainer, group.is_writer, root)
        results = []
        add = evaluator.add

        def recording_add(*args, add=add, results=results, **kwargs):
            result = add(*args, **kwargs)
            if result is not None:
                results.append({"pass": result.pass_, "step": result.step, **result.metrics})
            return result

        evaluator.add = recording_add
        service = build_service(
            job,
            cfg,
            env,
            group,
            device,
            trainer,
            training.cursor,
            stream=ScriptedStream(items(rank, batches)),
            save=functools.partial(write_checkpoint, root, export=trainer_export_config(trainer)),
            evaluator=evaluator,
            best=best,
            name=f"d0_r{rank}",
        )
        assert service.run() == EXIT_OK
        evaluated[mode] = {"passes": results, "steps": trainer.step, "holds_record": best is not None}
    torch.save(evaluated, Path(out_dir) / f"rank{rank}.pt")
    group.close()
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(a[0], a[1], a[2], int(a[3]), int(a[4]), int(a[5])))
