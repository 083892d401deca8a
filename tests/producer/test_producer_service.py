"""The producer's main loop (producer/service.py), in-process, built by producer/build.py with a stand-in
target (tests/procs/transport_pair.py: features a consumer can recompute) and a real consumer (BatchStream)
in a thread: each way it ends, its exit status, and that its ring leaves /dev/shm."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from common.config import parse_job
from common.supervisor import STOP_SIGNALS
from consumer.stream import BatchStream, ReceivedBatch, StreamEnd
from producer.build import build_service
from tests.procs.transport_pair import FakeTarget, features, make_batch


@pytest.fixture
def restore_signals():
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def make_job(tmp_path: Path, *, attach_s: float, on_dead_group: str = "block", slots: int = 3):
    job = parse_job(
        {
            "job": {"name": "ploop", "run_dir": str(tmp_path / "run")},
            "target": {"path": "unused", "dtype": "float32"},
            "data": {"path": "unused", "max_length": 64, "tokens_per_batch": 64},
            "transport": {
                "slots": slots,
                "heartbeat_interval_s": 0.1,
                "heartbeat_timeout_s": 1.0,
                "attach_timeout_s": attach_s,
                "on_dead_group": on_dead_group,
            },
            "drafters": [{"name": "d0"}],
        }
    )
    job.run_paths.make()
    return job


def producer(job, batches: int):
    return build_service(job, FakeTarget(), lambda start: (make_batch(s, 64) for s in range(start, batches)), batches)


class Consumer(threading.Thread):
    """Takes `n` batches (None: until END), checking every feature; then says bye, or (`vanish`) just goes."""

    def __init__(self, job, n: int | None = None, vanish: bool = False):
        super().__init__(daemon=True)
        self.job, self.n, self.vanish = job, n, vanish
        self.seqs: list[int] = []
        self.intact = True
        self.ended: StreamEnd | None = None

    def run(self) -> None:
        stream = BatchStream(self.job, "d0", 0, torch.device("cpu"), lambda: 0)
        try:
            stream.connect()
            while self.n is None or len(self.seqs) < self.n:
                item = stream.next(timeout_s=20)
                if not isinstance(item, ReceivedBatch):
                    self.ended = item
                    break
                self.seqs.append(item.seq)
                self.intact &= torch.equal(item.hidden, features(item.input_ids))
            if not self.vanish:
                stream.bye("test", self.seqs[-1] if self.seqs else -1)
        finally:
            stream.close()


def test_data_exhausted_every_batch_delivered_intact_exit_0_ring_removed(tmp_path, restore_signals):
    job = make_job(tmp_path, attach_s=30)
    service = producer(job, 6)
    ring = Path(service.ring.path)
    consumer = Consumer(job)
    consumer.start()
    assert service.run() == 0
    consumer.join(20)
    assert consumer.seqs == [0, 1, 2, 3, 4, 5] and consumer.intact
    assert consumer.ended == StreamEnd("data exhausted", 5)
    assert (service.counters.batches, service.counters.fenced, service.table.in_use) == (6, 0, 0)
    assert not ring.exists()


def test_the_next_forward_is_queued_before_the_last_batch_is_published(tmp_path, restore_signals):
    """As on a CUDA ring (overlap_forwards): forward n+1 goes in before batch n's BATCH is sent, the batches still
    go out in order, intact, each once, and the end of the data is the same. A slot for every batch: no wait for
    a release (then batch n goes out first) makes the order timing-dependent."""
    job = make_job(tmp_path, attach_s=30, slots=7)
    service = producer(job, 6)
    service.overlap_forwards = True
    events = []
    write, publish = service._write_slot, service._publish  # write: the forward into the slot, queued
    service._write_slot = lambda slot, batch: (events.append(("forward", batch.seq)), write(slot, batch))[1]
    service._publish = lambda slot, batch, layout: (
        events.append(("publish", batch.seq)),
        publish(slot, batch, layout),
    )[1]
    consumer = Consumer(job)
    consumer.start()
    assert service.run() == 0
    consumer.join(20)
    assert consumer.seqs == [0, 1, 2, 3, 4, 5] and consumer.intact
    assert consumer.ended == StreamEnd("data exhausted", 5)
    overlapped = [e for n in range(1, 6) for e in (("forward", n), ("publish", n - 1))]
    assert events == [("forward", 0), *overlapped, ("publish", 5)]
    assert (service.counters.batches, service.table.in_use) == (6, 0)


def test_a_stop_signal_while_waiting_for_consumers_exits_0(tmp_path, restore_signals):
    job = make_job(tmp_path, attach_s=30)
    service = producer(job, 6)
    ring = Path(service.ring.path)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    assert service.run() == 0  # a stop is no failure
    assert service.counters.batches == 0 and not ring.exists()


def test_no_consumer_within_the_attach_timeout_exits_2(tmp_path, restore_signals, caplog):
    job = make_job(tmp_path, attach_s=0.5)
    service = producer(job, 6)
    ring = Path(service.ring.path)
    assert service.run() == 2
    assert "no consumer attached for drafter(s) ['d0'] within transport.attach_timeout_s = 0 s" in caplog.text
    assert not ring.exists()


@pytest.mark.parametrize("vanish", [True, False], ids=["crashed", "said-bye"])
def test_skip_mode_ends_with_status_1_when_the_only_group_does_not_come_back(tmp_path, restore_signals, caplog, vanish):
    """The group left after 3 of 40 batches (a crash is fenced, a bye is not) and none came back within
    transport.attach_timeout_s: the job ends without its remaining batches, which is not a success."""
    job = make_job(tmp_path, attach_s=1.0, on_dead_group="skip")
    service = producer(job, 40)
    consumer = Consumer(job, n=3, vanish=vanish)
    consumer.start()
    assert service.run() == 1
    consumer.join(20)
    assert consumer.seqs == [0, 1, 2] and consumer.intact
    assert service.counters.fenced == int(vanish) and service.table.in_use == 0
    assert "no consumer of drafter(s) ['d0'] came back within 1 s" in caplog.text
