"""A consumer that trains nothing: it saves the first N batches it receives for the test to check.

python -m tests.procs.probe_consumer JOB.toml DRAFTER N OUT.pt
"""

import sys

import torch

from common.config import load_job
from consumer.stream import BatchStream, ReceivedBatch


def main(job_path: str, drafter: str, n: int, out: str) -> int:
    stream = BatchStream(load_job(job_path), drafter, 0, torch.device("cpu"), lambda: 0)
    batches = []
    try:
        stream.connect()
        while len(batches) < n:
            item = stream.next(timeout_s=60)
            if not isinstance(item, ReceivedBatch):
                break
            batches.append(
                {
                    "seq": item.seq,
                    "input_ids": item.input_ids.clone(),
                    "hidden": item.hidden.clone(),
                    "loss_mask": item.loss_mask.clone(),
                    "cu_seqlens": item.cu_seqlens.clone(),
                    "sample_ids": torch.tensor(item.sample_ids),
                }
            )
        torch.save(batches, out)
        stream.bye("probe done", -1)
    finally:
        stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
