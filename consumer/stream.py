"""A consumer's side of the hand-off: attach to the producer's ring once, then turn BATCH messages into
batches copied out of their slots (slots released at once), until END.

The trainer sees an iterator of `ReceivedBatch`; sessions, fencing and re-attachment stay in here; the
copy itself (buffers, CUDA streams and events) is consumer/copy_out.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.channel import ConsumerChannel, PeerLost
from common.config import JobConfig
from common.fp8 import dequantized
from common.packed_batch import NAMES, SCALE, PackedBatch
from common.profile import ProfileStats
from common.protocol import Attached, Batch, Bye, End, Fail, Hello, Release, Welcome, describe
from common.ring import DTYPES, SEQ_TAG, RingError, SlotRing, layout_from_wire
from common.security import client_curve, private_dir
from consumer.copy_out import CopyOut, copy_out_rows

log = logging.getLogger("consumer")

STOP_POLL_S = 0.2  # how often a wait for the producer looks at `stopping()`


class ProducerLost(RuntimeError):
    """The producer stopped answering (crash, kill, network): the caller checkpoints and exits non-zero."""


class ConsumerRejected(RuntimeError):
    """The producer refused this consumer for good (unknown drafter, incompatible ring)."""


class StopRequested(RuntimeError):
    """SIGTERM/SIGINT while waiting for the producer: give up the wait, the caller exits cleanly."""


@dataclass
class ReceivedBatch(PackedBatch):
    """A batch copied out of its slot (`hidden` set; `cu_seqlens` on the host).

    Its tensors are views of the stream's reused copy-out buffers, valid until the next call to `next()`:
    whoever keeps a batch past that copies it (consumer/copy_out.py says why and how CUDA overlaps)."""

    received_at: float = 0.0
    validation: tuple[int, int, int] | None = None  # (pass, index, count) of a validation batch: evaluate only


@dataclass(frozen=True)
class StreamEnd:
    reason: str
    last_seq: int


class BatchStream:
    def __init__(
        self,
        job: JobConfig,
        drafter: str,
        replica: int,
        device: torch.device,
        resume_seq: Callable[[], int],
        prof: ProfileStats | None = None,
        *,
        node: int = 0,
        launch_id: str = "",
        stopping: Callable[[], bool] = lambda: False,
        producer: int = 0,
        copy_out: CopyOut | None = None,
    ):
        """`resume_seq()` gives the next seq this drafter needs (asked again on every re-attachment);
        `launch_id` is the launch this process belongs to (common/joblock.py); `stopping()` is polled while
        waiting for the producer, so a SIGTERM during start-up is honoured at once (raises `StopRequested`);
        `producer`: which target replica's producer this stream attaches to (consumer/fanin.py holds one each);
        `copy_out`: the copy-out the node's streams share (one batch is in flight at a time); None: its own, made
        once the ring is attached."""
        self.job = job
        self.node = node
        self.launch_id = launch_id
        self.stopping = stopping
        self.drafter = drafter
        self.replica = replica
        self.device = device
        self.resume_seq = resume_seq
        self.prof = prof
        self.producer = producer
        t = job.transport
        private_dir(job.run_paths.sockets)  # never talk through a folder another user controls
        endpoint = (
            job.run_paths.ipc(job.run_paths.control_socket(producer)) if t.endpoint == "ipc" else self._tcp_endpoint()
        )
        curve = client_curve(job.run_paths) if t.use_curve else None  # the producer made the keys before binding
        # the launch is part of the identity: ROUTER_HANDOVER gives an identity to a newcomer of the same launch
        # (a restarted replica), never to one of another launch, whose HELLO the producer then rejects
        identity = f"{drafter}.{replica}" + (f".{launch_id}" if launch_id else "")
        self.channel = ConsumerChannel(endpoint, identity, t.heartbeat_interval_s, t.heartbeat_timeout_s, curve=curve)
        self.ring: SlotRing | None = None
        self.epoch = -1
        self.dropped_stale = 0  # batches discarded because this process stalled past the fence bound
        self.dropped_reused = 0  # batches discarded because their slot held another batch by the time we read it
        self.reattached = 0
        self.last_copy_s = 0.0  # copy-out time of the last batch, so callers can tell waiting from copying
        self._copy = copy_out
        self._session_stalls = 0  # the channel's stall count when this session began

    def _tcp_endpoint(self) -> str:
        path = self.job.run_paths.control_endpoint(self.producer)
        deadline = time.monotonic() + self.job.transport.attach_timeout_s
        while not path.exists():
            if self.stopping():
                raise StopRequested("stopped while waiting for the producer's endpoint")
            if time.monotonic() > deadline:
                raise ProducerLost(f"no producer endpoint in {path} after {self.job.transport.attach_timeout_s:.0f} s")
            time.sleep(0.1)
        return path.read_text().strip()

    # ------------------------------------------------------------------ session
    def connect(self) -> None:
        """HELLO → WELCOME → attach the ring (first time only) → ATTACHED."""
        gpu = torch.cuda.get_device_properties(self.device).uuid if self.device.type == "cuda" else ""
        resume = self.resume_seq()
        self.channel.send(
            Hello(
                self.drafter,
                self.replica,
                os.getpid(),
                str(gpu),
                resume,
                self.ring is not None,
                self.node,
                self.launch_id,
            )
        )
        timeout = self.job.transport.attach_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            if self.stopping():
                raise StopRequested("stopped while waiting for the producer")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProducerLost(f"no WELCOME from the producer within {timeout:.0f} s (transport.attach_timeout_s)")
            ev = self.channel.recv(min(left, STOP_POLL_S))
            if ev is None:
                continue
            if isinstance(ev, PeerLost):
                raise ProducerLost(f"producer lost while attaching: {ev.reason}")
            msg = ev.msg
            if isinstance(msg, Fail) and msg.fatal:
                raise ConsumerRejected(f"producer refused {self.drafter}.r{self.replica}: {msg.reason}")
            if isinstance(msg, Welcome):
                break
            log.debug("ignoring %s while attaching", describe(msg))
        if self.ring is None:  # the ring lives as long as the producer: opened once per process
            try:
                self.ring = SlotRing.attach(msg.ring, device=str(self.device) if self.device.type == "cuda" else None)
            except RingError as err:
                self.channel.send(Fail(f"cannot attach the ring: {err}"))
                raise ConsumerRejected(f"cannot attach the producer's ring: {err}") from err
            if self._copy is None:
                self._copy = CopyOut(self.device, self.ring.device, copy_out_rows(self.job))
        self.epoch = msg.epoch
        self._session_stalls = self.channel.stalls
        self.channel.send(Attached(self.epoch))
        log.info(
            "%s.r%d attached (session %d, %s ring of %d × %.1f MiB), resuming at seq %d",
            self.drafter,
            self.replica,
            self.epoch,
            msg.transport,
            msg.num_slots,
            msg.slot_bytes / 2**20,
            resume,
        )

    def next(self, timeout_s: float) -> ReceivedBatch | StreamEnd | None:
        """The next batch (copied out, its slot released), END, or None after `timeout_s` of silence."""
        deadline = time.monotonic() + timeout_s
        while True:
            ev = self.channel.recv(max(0.0, deadline - time.monotonic()))
            if ev is None:
                return None
            if isinstance(ev, PeerLost):
                raise ProducerLost(f"lost the producer: {ev.reason}")
            msg = ev.msg
            if isinstance(msg, Batch) and msg.epoch == self.epoch:
                batch = self._copy_out(msg, ev.time)
                if batch is not None:
                    return batch
            elif isinstance(msg, End):
                return StreamEnd(msg.reason, msg.last_seq)
            elif isinstance(msg, Fail):
                if msg.fatal:
                    raise ConsumerRejected(f"producer: {msg.reason}")
                self._reattach(msg.reason)

    def _copy_out(self, msg: Batch, received_at: float) -> ReceivedBatch | None:
        assert self.ring is not None and self._copy is not None
        start = time.perf_counter()
        try:
            views = self.ring.view(msg.slot, layout_from_wire(msg.layout))
            missing = set(NAMES) - views.keys()
            if missing:
                raise RingError(f"layout lacks {sorted(missing)}")
            if views["hidden"].dtype == torch.float8_e4m3fn and SCALE not in views:
                raise RingError(f"FP8 hidden without its {SCALE!r} column")
        except RingError as err:
            log.error("batch %d: bad layout from the producer (%s); releasing it untouched", msg.seq, err)
            self._release(msg)
            return None
        tag = views.pop(SEQ_TAG, None)
        # when copy() returns the reads are complete (the slot may be reused once released) and the tag,
        # read after the data, is in host memory
        out, seq_tag = self._copy.copy(views, tag)
        if self.channel.stalled_since(received_at) or self.channel.stalls != self._session_stalls:
            # we may have been fenced while stopped and the slot rewritten under us: trust nothing of this
            # session, even a batch that reached us after we woke (it may have been sent before the fence)
            self.dropped_stale += 1
            self._reattach("this process stalled past the heartbeat bound")
            return None
        if seq_tag is not None and seq_tag != msg.seq:
            self.dropped_reused += 1
            log.error(
                "batch %d: slot %d holds seq tag %d, so it was reused before we read it; dropping the"
                " batch and re-attaching",
                msg.seq,
                msg.slot,
                seq_tag,
            )
            self._reattach("a slot was reused under this session")
            return None
        self._release(msg)
        out = dequantized(out, DTYPES[self.job.target.dtype])  # FP8 hand-off: back to the target's dtype
        self.last_copy_s = time.perf_counter() - start
        if self.prof:
            self.prof.add("copy_out", self.last_copy_s)
        if not msg.val_pass:  # a validation batch's seq is a slot tag, not the plan's (common/protocol.py)
            self.channel.last_seq = msg.seq
        return ReceivedBatch(
            msg.seq,
            msg.data_epoch,
            msg.sample_ids,
            **{n: out[n] for n in NAMES},
            received_at=received_at,
            validation=(msg.val_pass, msg.val_index, msg.val_count) if msg.val_pass else None,
        )

    def _release(self, msg: Batch) -> None:
        self.channel.send(Release(self.epoch, [(msg.seq, msg.slot)]))

    def _reattach(self, why: str) -> None:
        """Start a new session: whatever this session was sent but did not train is sent again."""
        self.reattached += 1
        log.warning("%s.r%d re-attaching: %s", self.drafter, self.replica, why)
        self.connect()

    def bye(self, reason: str, trained_seq: int) -> None:
        self.channel.send(Bye(reason, trained_seq))  # close() flushes it

    def close(self) -> None:
        self.channel.close()
        if self.ring is not None:
            self.ring.close()
            self.ring = None


__all__ = ["BatchStream", "ConsumerRejected", "ProducerLost", "ReceivedBatch", "StopRequested", "StreamEnd"]
