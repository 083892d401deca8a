"""Regressions in the consumer's batch stream: what it must not trust after a stall or a slot reuse."""

import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.channel import ProducerChannel
from common.config import parse_job
from common.protocol import Attached, Batch, Fail, Hello, Release, Welcome
from common.ring import SEQ_TAG, SlotRing, layout_to_wire
from consumer.stream import BatchStream, ConsumerRejected
from producer.service import slot_layout
from tests.common.test_channel import wait_for

T, WIDTH = 8, 4


@pytest.fixture
def pair(tmp_path):
    """A real BatchStream against a hand-driven producer channel and a real CPU ring."""
    job = parse_job(
        {
            "job": {"run_dir": str(tmp_path / "run")},
            "target": {"path": "x"},
            "data": {"path": "y"},
            "drafters": [{"name": "d0"}],
            "transport": {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0, "attach_timeout_s": 10},
        }
    )
    job.run_paths.make()
    ring = SlotRing.create("cpu", 2, 64 * 1024, name=f"faults-{secrets.token_hex(4)}")
    prod = ProducerChannel(job.run_paths.ipc("control.sock"), 0.1, 1.0)
    stream = BatchStream(job, "d0", 0, torch.device("cpu"), resume_seq=lambda: 0)
    pool = ThreadPoolExecutor(1)
    yield stream, prod, ring, pool
    pool.shutdown(wait=False, cancel_futures=True)
    stream.close()
    prod.close()
    ring.close()


def welcome(prod, ring, epoch, *, first_fail=False):
    hello = wait_for(prod, Hello)
    if first_fail:  # answer to a message of the previous session, overtaking the WELCOME
        prod.send(hello.peer, Fail("fenced: unknown session, send HELLO again", fatal=False))
    handle = {} if hello.msg.ring_attached else ring.handle()
    prod.send(hello.peer, Welcome(epoch, "cpu", ring.num_slots, ring.slot_bytes, handle, 0.1, 1.0))
    wait_for(prod, Attached)
    return hello.peer


def publish(prod, ring, peer, epoch, seq, slot, tag=None):
    layout = slot_layout(T, 1, WIDTH, "float32")
    views = ring.view(slot, layout)
    views["hidden"].fill_(float(seq))
    views["input_ids"].fill_(seq)
    views["loss_mask"].fill_(1)
    views["cu_seqlens"].copy_(torch.tensor([0, T], dtype=torch.int32))
    views[SEQ_TAG].fill_(seq if tag is None else tag)
    prod.send(peer, Batch(epoch, seq, slot, 0, layout_to_wire(layout), [seq], T, T))


def test_a_non_fatal_fail_while_attaching_is_not_a_rejection(pair):
    stream, prod, ring, pool = pair
    attaching = pool.submit(stream.connect)
    welcome(prod, ring, 3, first_fail=True)
    attaching.result(timeout=10)
    assert stream.epoch == 3


def test_a_fatal_fail_while_attaching_is_a_rejection(pair):
    stream, prod, _ring, pool = pair
    attaching = pool.submit(stream.connect)
    hello = wait_for(prod, Hello)
    prod.send(hello.peer, Fail("no drafter 'd0' in this job", fatal=True))
    with pytest.raises(ConsumerRejected, match="no drafter"):
        attaching.result(timeout=10)


def test_a_slot_reused_before_the_copy_is_dropped_and_the_stream_reattaches(pair):
    stream, prod, ring, pool = pair
    attaching = pool.submit(stream.connect)
    peer = welcome(prod, ring, 1)
    attaching.result(timeout=10)
    publish(prod, ring, peer, 1, seq=4, slot=0, tag=9)  # slot 0 already holds seq 9's data
    got = pool.submit(stream.next, 10.0)
    peer = welcome(prod, ring, 2)  # the stream re-attaches instead of training seq 4
    publish(prod, ring, peer, 2, seq=4, slot=1)
    batch = got.result(timeout=10)
    assert batch.seq == 4 and torch.equal(batch.input_ids, torch.full((T,), 4))
    assert stream.dropped_reused == 1 and stream.reattached == 1
    release = wait_for(prod, Release)
    assert release.msg.epoch == 2 and release.msg.pairs == [(4, 1)]  # nothing released for the dropped one


def test_no_batch_of_a_session_that_saw_a_stall_is_trusted(pair):
    """Found by reading the stall check under the soak: a BATCH the I/O thread received after the stall was
    noticed (sent before the producer fenced us) passed `stalled_since(received_at)`. Now a session that saw
    any stall trusts none of its batches."""
    stream, prod, ring, pool = pair
    attaching = pool.submit(stream.connect)
    peer = welcome(prod, ring, 1)
    attaching.result(timeout=10)
    stream.channel.stalls += 1  # what the I/O thread records when it wakes from a SIGSTOP
    publish(prod, ring, peer, 1, seq=0, slot=0)
    got = pool.submit(stream.next, 10.0)
    peer = welcome(prod, ring, 2)
    publish(prod, ring, peer, 2, seq=0, slot=1)
    assert got.result(timeout=10).seq == 0
    assert stream.dropped_stale == 1 and stream.dropped_reused == 0
