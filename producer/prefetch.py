"""Tokenization ahead of the forward: a background thread turns planned batches into packed tensors.

The thread reads and tokenizes the samples of each planned batch and packs them (no padding) into a bounded
queue, so the target forward finds its next batch ready. Every queue operation has a timeout: the worker
re-checks its stop flag between tries, and the consumer side gets a TimeoutError it can act on (heartbeats,
shutdown) instead of hanging. Time spent waiting in `get` is the stall, measured in `wait_s`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable

import torch

from common.packed_batch import PackedBatch
from producer.data import ChatDataset, SampleReader
from producer.plan import PlannedBatch


def pack_batch(reader: SampleReader, planned: PlannedBatch) -> PackedBatch:
    """One planned batch as the ring stores it (common/packed_batch.py): sequences end to end, no padding;
    `hidden` stays None, the target forward writes it straight into the slot."""
    ids: list[int] = []
    mask: list[int] = []
    cu = [0]
    for sample in planned.sample_ids:
        sample_ids, sample_mask = reader.read(sample)
        ids += sample_ids
        mask += sample_mask
        cu.append(len(ids))
    return PackedBatch(
        seq=planned.seq,
        epoch=planned.epoch,
        sample_ids=planned.sample_ids,
        input_ids=torch.tensor(ids, dtype=torch.int64),
        loss_mask=torch.tensor(mask, dtype=torch.uint8),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
    )


_END = object()


class Prefetcher:
    """Background tokenizer: `get()` returns the next PackedBatch, None at the end of the plan.

    Use as a context manager (or call start/close). A failure in the worker is re-raised by `get`.
    """

    def __init__(self, dataset: ChatDataset, batches: Iterable[PlannedBatch], depth: int, poll_s: float = 0.1):
        self.dataset = dataset
        self.batches = batches
        self.poll_s = poll_s
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.wait_s = 0.0  # total time `get` waited for a batch: the forward's data stall
        self.thread = threading.Thread(target=self._run, name="producer-tokenizer", daemon=True)

    def __enter__(self) -> Prefetcher:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=self.poll_s)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        reader = self.dataset.reader()
        try:
            for planned in self.batches:
                if not self._put(pack_batch(reader, planned)):
                    return
        except BaseException as err:  # handed to the consumer side, which raises it
            self.error = err
        finally:
            reader.close()
        self._put(_END)

    def get(self, timeout: float) -> PackedBatch | None:
        """The next batch; None when the plan is exhausted; TimeoutError when none came within `timeout`."""
        start = time.perf_counter()
        try:
            item = self.queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no tokenized batch within {timeout:.1f} s") from None
        finally:
            self.wait_s += time.perf_counter() - start
        if item is _END:
            self._put(_END)  # later calls see the end too
            if self.error is not None:
                raise RuntimeError(f"tokenizer thread failed: {self.error}") from self.error
            return None
        return item

    def close(self, timeout: float = 5.0) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
