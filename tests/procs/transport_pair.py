"""Stand-in producer and consumer for transport tests: the real ProducerService and BatchStream, with a
fake target and batch source whose every byte the consumer can recompute from the batch's seq.

    python -m tests.procs.transport_pair producer JOB.toml NUM_BATCHES OUT.json [DELAY_S]
    python -m tests.procs.transport_pair consumer JOB.toml DRAFTER REPLICA OUT.json [RESUME_SEQ [DELAY_S]]

DELAY_S: the producer's batch source takes that long per batch (every consumer attaches before the data is
dealt); the consumer sleeps that long after each batch (a slow consumer: batches wait in its queue). A
re-attaching consumer asks for the seq after the highest it took, as consumer/resume_points.py does.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch

from common.config import load_job

WIDTH = 64


@dataclass
class FakeBatch:
    seq: int
    epoch: int
    sample_ids: list[int]
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor


def make_batch(seq: int, max_tokens: int) -> FakeBatch:
    g = torch.Generator().manual_seed(1000 + seq)
    tokens = int(torch.randint(8, max_tokens + 1, (1,), generator=g))
    cuts = torch.sort(torch.randperm(tokens - 1, generator=g)[:3] + 1).values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])]).to(torch.int32)
    ids = torch.randint(0, 50_000, (tokens,), generator=g)
    mask = torch.randint(0, 2, (tokens,), generator=g, dtype=torch.uint8)
    return FakeBatch(seq, 0, [seq * 10 + i for i in range(len(cu) - 1)], ids, mask, cu)


def slow(batch: FakeBatch, delay_s: float) -> FakeBatch:
    time.sleep(delay_s)
    return batch


def features(input_ids: torch.Tensor) -> torch.Tensor:
    return input_ids[:, None].float() * 1e-3 + torch.arange(WIDTH, dtype=torch.float32)[None, :]


class FakeTarget:
    feature_width = WIDTH
    dtype = torch.float32

    def forward(self, input_ids, cu_seqlens, out):
        out.copy_(features(input_ids))
        return out


def producer(job_path: str, num_batches: int, out_path: str, delay_s: float = 0.0) -> int:
    from producer.build import build_service

    job = load_job(job_path)
    job.run_paths.make()
    service = build_service(
        job,
        FakeTarget(),
        lambda start: (slow(make_batch(s, job.data.tokens_per_batch), delay_s) for s in range(start, num_batches)),
        num_batches,
    )
    ring_path = service.ring.path
    status = service.run()
    write_json(
        out_path,
        {
            "status": status,
            "in_use": service.table.in_use,
            "batches": service.counters.batches,
            "fenced": service.counters.fenced,
            "ring_path": ring_path,
            "rejected_hellos": service.counters.rejected_hellos,
        },
    )
    return status


def consumer(job_path: str, drafter: str, replica: int, out_path: str, resume: int = 0, delay_s: float = 0.0) -> int:
    from consumer.stream import BatchStream, ProducerLost, ReceivedBatch

    job = load_job(job_path)
    seqs, bad = [], []
    stream = BatchStream(job, drafter, replica, torch.device("cpu"), lambda: max([resume - 1, *seqs]) + 1)
    try:
        stream.connect()
        while True:
            item = stream.next(timeout_s=30)
            if item is None:
                print("no batch for 30 s", file=sys.stderr)
                return 4
            if not isinstance(item, ReceivedBatch):
                break
            want = make_batch(item.seq, job.data.tokens_per_batch)
            ok = (
                torch.equal(item.input_ids, want.input_ids)
                and torch.equal(item.loss_mask, want.loss_mask)
                and torch.equal(item.cu_seqlens, want.cu_seqlens)
                and torch.equal(item.hidden, features(want.input_ids))
                and item.sample_ids == want.sample_ids
            )
            seqs.append(item.seq)
            if not ok:
                bad.append(item.seq)
            write_json(out_path, {"seqs": seqs, "bad": bad, "done": False})  # progress for the test
            time.sleep(delay_s)
        stream.bye("end of data", seqs[-1] if seqs else -1)
    except ProducerLost as err:
        print(f"LOST_AT {time.time():.3f}: {err}", flush=True)
        return 3
    finally:
        stream.close()
    write_json(out_path, {"seqs": seqs, "bad": bad, "done": True, "reattached": stream.reattached})
    return 0


def write_json(path: str, obj: dict) -> None:
    with open(f"{path}.tmp", "w") as f:
        json.dump(obj, f)
    os.replace(f"{path}.tmp", path)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    role, job_path, *rest = sys.argv[1:]
    if role == "producer":
        sys.exit(producer(job_path, int(rest[0]), rest[1], *map(float, rest[2:3])))
    sys.exit(consumer(job_path, rest[0], int(rest[1]), rest[2], *(int(r) for r in rest[3:4]), *map(float, rest[4:5])))
