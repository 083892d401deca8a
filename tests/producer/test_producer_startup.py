"""The producer's start-up order and host/forward overlap (issue 19 item 5): its GPU made current before
anything touches CUDA, the ring allocated before the target loads (a CUDA ring must be alone in its
allocator segment), a ring that does not fit the loaded target refused, and the next batch read and packed
while the current forward runs. CUDA itself is stood in for: the order is what is checked."""

import json
import secrets
import threading
from pathlib import Path

import pytest
import torch

import producer.__main__ as producer_main
import producer.build as producer_build
from bench import harness
from common.config import parse_job
from common.packed_batch import required_slot_bytes
from common.ring import RingError, SlotRing
from producer.plan import PlannedBatch
from producer.service import ProducerService
from producer.target import TargetLoadError
from tests.procs.transport_pair import FakeTarget


def write_job(tmp_path: Path) -> Path:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "hidden_size": 48,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 96,
                "vocab_size": 128,
                "head_dim": 12,
            }
        )
    )
    return harness.write_job(
        tmp_path / "job.toml",
        {
            "job": {"name": f"startup-{secrets.token_hex(4)}", "run_dir": str(tmp_path / "run")},
            "target": {"path": str(target), "layer_ids": [1, 3], "replicas": 2, "devices": ["cuda:0", "cuda:1"]},
            "data": {"path": str(tmp_path / "data.jsonl"), "max_length": 64, "tokens_per_batch": 64},
            "telemetry": {"interval_s": 0},
            "drafters": [{"name": "d0"}],
        },
    )


def test_a_replica_makes_its_gpu_current_then_the_ring_then_loads_the_target(tmp_path, monkeypatch):
    calls, rings = [], []

    def create_ring(job, replica, ring_name, feature_width, feature_dtype):
        calls.append(("ring", job.target.devices_of(replica)[0], feature_width, feature_dtype))
        rings.append(SlotRing.create("cpu", 2, required_slot_bytes(64, feature_width, feature_dtype), name=ring_name))
        return rings[-1]

    def load_target(path, layer_ids, num_features, dtype, device, *args):
        calls.append(("load_target", device))
        raise TargetLoadError(f"{path}: stand-in, nothing to load")

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(producer_build, "create_ring", create_ring)
    monkeypatch.setattr(producer_build, "load_target", load_target)
    assert producer_main.main(["--job", str(write_job(tmp_path)), "--replica", "1"]) == 2
    # replica 1's GPU is cuda:1: current first; the ring sized from config.json (2 layers x 48, bf16) before the load
    assert calls == [("set_device", "cuda:1"), ("ring", "cuda:1", 96, "bfloat16"), ("load_target", "cuda:1")]
    assert not Path(rings[0].path).exists(), "a producer that failed to start left its ring behind"


def test_a_ring_made_before_the_target_that_cannot_hold_its_batches_is_refused_and_removed(tmp_path):
    job = parse_job(
        {
            "job": {"run_dir": str(tmp_path / "run"), "name": f"small-{secrets.token_hex(4)}"},
            "target": {"path": "x", "dtype": "float32"},
            "data": {"path": "y", "max_length": 64, "tokens_per_batch": 64},
            "drafters": [{"name": "d0"}],
        }
    )
    job.run_paths.make()
    small = SlotRing.create(
        "cpu", 2, required_slot_bytes(64, FakeTarget.feature_width - 1, "float32"), name=job.ring_name(0)
    )
    with pytest.raises(RingError, match=r"the loaded target's largest batch needs \d+ \(64 float32 features"):
        ProducerService(job, FakeTarget(), lambda s: iter(()), 1, ring_name=job.ring_name(0), ring=small)
    assert not Path(small.path).exists()


class GatedSamples:
    """A dataset stand-in whose sample k (k >= 1) can only be read once the forward of batch k - 1 began."""

    def __init__(self, n: int):
        self.forward_began = [threading.Event() for _ in range(n)]
        self.was_read = [threading.Event() for _ in range(n)]

    def reader(self):
        return self

    def read(self, k: int) -> tuple[list[int], list[int]]:
        if k and not self.forward_began[k - 1].wait(30):
            raise TimeoutError(f"sample {k}: the forward of batch {k - 1} never began")
        self.was_read[k].set()
        return [k] * 4, [1] * 4

    def close(self) -> None:
        pass


class OneSamplePerBatch:
    def __init__(self, n: int):
        self.batches = [PlannedBatch(seq, 0, (seq,), 4) for seq in range(n)]

    def batches_from(self, seq: int):
        return iter(self.batches[seq:])


def test_the_next_batch_is_read_and_packed_while_the_current_forward_runs():
    """Forward n waits until batch n + 1 was read, which cannot start before forward n began: a producer that
    prepared batch n + 1 only after forward n returned would time out here instead."""
    n = 4
    data = GatedSamples(n)
    seen = []
    for batch in producer_build.batch_stream(data, OneSamplePerBatch(n), depth=1)(0):
        data.forward_began[batch.seq].set()  # the target forward of this batch runs from here...
        if batch.seq + 1 < n:
            assert data.was_read[batch.seq + 1].wait(30), (
                f"batch {batch.seq + 1} was not read during forward {batch.seq}"
            )
        seen.append((batch.seq, batch.input_ids.tolist(), batch.cu_seqlens.tolist()))  # ...to here
    assert seen == [(k, [k] * 4, [0, 4]) for k in range(n)]
