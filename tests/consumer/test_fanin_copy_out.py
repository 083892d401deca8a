"""A consumer fed by two producers (consumer/fanin.py) copies out into one CopyOut: one batch is in flight at
a time, so the buffers are one stream's, and the memory plan's copy-out figure is what the fan-in allocates."""

import torch

from bench.harness import write_job
from common.config import load_job
from common.packed_batch import HOST_FIELDS
from consumer.build import build_stream
from consumer.copy_out import sets_for
from consumer.distributed import GroupEnv
from consumer.fanin import FanIn
from consumer.memory_plan import copy_out_bytes

TOKENS, WIDTH = 64, 12  # tokens_per_batch; feature width n·H


class _Resume:
    def seq(self, producer: int = 0) -> int:
        return 0


class _Stop:
    def requested(self) -> bool:
        return False


def _fanin_job(tmp_path):
    doc = {
        "job": {"name": "fanin", "run_dir": str(tmp_path / "run")},
        "target": {"path": str(tmp_path), "dtype": "bfloat16", "num_features": 3, "replicas": 2},
        "data": {"path": str(tmp_path / "chats.jsonl"), "max_length": 32, "tokens_per_batch": TOKENS},
        "drafters": [{"name": "d"}],
    }
    return load_job(write_job(tmp_path / "job.toml", doc))


def _slot(tokens: int, fill: int) -> dict[str, torch.Tensor]:
    """A batch as a ring slot holds it (the views a stream copies from)."""
    return {
        "hidden": torch.full((tokens, WIDTH), float(fill), dtype=torch.bfloat16),
        "input_ids": torch.full((tokens,), fill, dtype=torch.int64),
        "loss_mask": torch.ones(tokens, dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, tokens], dtype=torch.int32),
    }


def test_a_fan_in_allocates_the_copy_out_the_plan_counts(tmp_path):
    job = _fanin_job(tmp_path)
    env = GroupEnv(0, 1, 0, 0, 1, "127.0.0.1", 0)
    fanin = build_stream(job, job.drafters[0], env, torch.device("cpu"), _Resume(), _Stop())
    try:
        assert isinstance(fanin, FanIn) and len(fanin.streams) == 2
        copiers = {id(s._copy): s._copy for s in fanin.streams if s._copy is not None}
        assert len(copiers) == 1 and all(s._copy is not None for s in fanin.streams), "not one shared copy-out"
        # the largest batches, from each producer in turn, as the fan-in hands them to the trainer
        for seq in range(4):
            stream = fanin.streams[seq % 2]
            out, _ = stream._copy.copy(_slot(TOKENS, seq), None)
            assert float(out["hidden"][0, 0]) == seq and out["hidden"].shape == (TOKENS, WIDTH)
        allocated = sum(
            t.untyped_storage().nbytes()
            for copier in copiers.values()
            for bufset in copier.sets.sets
            for name, t in bufset.tensors.items()
            if name not in HOST_FIELDS
        )
    finally:
        fanin.close()
    rows = TOKENS + 1  # CopyOut's buffers are allocated at tokens_per_batch + 1 rows
    assert allocated == rows * (WIDTH * 2 + 8) == copy_out_bytes(job, WIDTH, cuda=False)
    # a CUDA consumer keeps two sets (the copy of batch n+1 overlaps the step on n): what the plan counts
    assert sets_for(True) == 2 and copy_out_bytes(job, WIDTH) == 2 * allocated
