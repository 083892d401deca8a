"""The producer loop: data → target forward → slot → BATCH to every drafter group → releases.

One target forward serves every drafter. On a CUDA ring the next batch's forward is queued before the last
one's writes are waited for and it is published (one batch in flight), so the GPU never idles between two
forwards; a CPU forward is synchronous and is published at once. The loop reads top to bottom in `run()`;
its stages and slot waits are the helpers below it. The consumers' messages are served by
producer/sessions.py wherever the loop waits; the wait for the groups before the first batch, the decision that
the stream is over and the farewell are producer/stream_ends.py's; evaluation passes are run by
producer/validation_passes.py where the loop says one may be due. Every wait is a poll with a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable, Generator, Iterator

import torch

from common.accounting import DeliveryLedger
from common.backoff import Backoff
from common.channel import ProducerChannel
from common.config import JobConfig
from common.fp8 import quantize_rows
from common.host_memory import keep_freed_memory
from common.packed_batch import FIELDS, SCALE, PackedBatch, required_slot_bytes, slot_feature_dtype, slot_items
from common.profile import ProfileStats, timed
from common.protocol import Batch
from common.ring import DTYPES, RingError, SlotRing, TensorSpec, layout_to_wire, plan_layout
from common.security import private_dir, server_curve
from common.startup import StartupBeat
from common.stats import StatsSink
from common.supervisor import STOP_SIGNALS, stop_reason
from producer.delivery import Delivery
from producer.sessions import POLL_S, ConsumerSessions, ProducerCounters
from producer.slot_table import SlotTable
from producer.stream_ends import StreamEnds
from producer.target import TargetCapture
from producer.validation import HeldOut
from producer.validation_passes import ValidationPasses

log = logging.getLogger("producer")


def slot_layout(tokens: int, sequences: int, feature_width: int, feature_dtype: str) -> list[TensorSpec]:
    """Where a packed batch's tensors lie in a slot (common/packed_batch.py describes them)."""
    return plan_layout(slot_items(tokens, sequences, feature_width, feature_dtype))


def create_ring(job: JobConfig, replica: int, ring_name: str, feature_width: int, feature_dtype: str) -> SlotRing:
    """The ring of target replica `replica`, on its first device, sized for the job's largest batch. The
    producer makes it before the target loads: a CUDA ring must be the first allocation on its GPU, alone in
    its allocator segment (common/ring_cuda.py), which a loaded target's cached blocks can prevent."""
    slot_bytes = job.transport.slot_bytes or required_slot_bytes(
        job.data.tokens_per_batch, feature_width, feature_dtype
    )
    return SlotRing.create(
        job.transport_kind, job.transport.slots, slot_bytes, name=ring_name, device=job.target.devices_of(replica)[0]
    )


class ProducerService:
    def __init__(
        self,
        job: JobConfig,
        target: TargetCapture,
        batches_from: Callable[[int], Iterator[PackedBatch]],
        total_batches: int,
        *,
        ring_name: str,
        ring: SlotRing | None = None,
        prof: ProfileStats | None = None,
        stats: StatsSink | None = None,
        ledger: DeliveryLedger | None = None,
        launch_id: str = "",
        node: int = 0,
        replica: int = 0,
        beat: StartupBeat | None = None,
        held_out: HeldOut | None = None,
    ):
        """`ledger`: the job log every delivered batch is appended to (common/accounting.py); `launch_id`: the
        launch this producer belongs to (common/joblock.py), which every HELLO must carry; `node`: its node rank;
        `replica`: which target replica it is (it makes the seqs replica, replica + replicas, ... of the plan);
        `ring`: made by `create_ring` before the target loaded (None: made here), owned by the service now;
        `held_out`: the validation records whose passes this producer runs (producer/validation_passes.py)."""
        self.job = job
        self.target = target
        self.batches_from = batches_from
        self.prof = prof
        self.stats = stats
        self.beat = beat
        self._startup: contextlib.ExitStack | None = None  # the "first batch" phase, until it is delivered
        self.ledger = ledger
        self.counters = ProducerCounters()
        if job.transport_kind == "cpu":
            keep_freed_memory()  # each forward's activations reuse the last forward's pages (common/host_memory.py)
        target_dtype = str(target.dtype).removeprefix("torch.")
        assert target_dtype in DTYPES
        self.feature_dtype = slot_feature_dtype(target_dtype, job.transport.features)  # hidden's dtype in a slot
        self._features: torch.Tensor | None = None  # FP8 hand-off: the forward's output, quantised into the slot
        t = job.transport
        self.ring = ring or create_ring(job, replica, ring_name, target.feature_width, self.feature_dtype)
        need = required_slot_bytes(job.data.tokens_per_batch, target.feature_width, self.feature_dtype)
        try:
            if self.ring.slot_bytes < need:
                raise RingError(
                    f"the ring's slots hold {self.ring.slot_bytes} bytes, the loaded target's largest"
                    f" batch needs {need} ({target.feature_width} {self.feature_dtype} features per token)"
                )
            private_dir(job.run_paths.sockets)  # whoever can write there can talk to us: this user alone
            curve = server_curve(job.run_paths) if t.use_curve else None
        except BaseException:
            self.ring.close()
            raise
        self.table = SlotTable(job.transport.slots)
        self.delivery = Delivery(
            [d.name for d in job.drafters],
            total_batches,
            job.transport.on_dead_group,
            stride=job.target.replicas,
            offset=replica,
        )
        try:
            self.channel = ProducerChannel(
                job.run_paths.ipc(job.run_paths.control_socket(replica))
                if t.endpoint == "ipc"
                else f"tcp://{t.tcp_host}:{t.tcp_port or '*'}",
                t.heartbeat_interval_s,
                t.heartbeat_timeout_s,
                curve=curve,
            )
        except BaseException:
            self.ring.close()  # a producer that cannot listen must not leave its ring in /dev/shm
            raise
        job.run_paths.control_endpoint(replica).write_text(self.channel.endpoint)
        self._stop_reason: str | None = None
        self._stream: Generator[PackedBatch, None, None] | None = None
        self._stream_next = -1
        # the batch whose forward was queued last, not yet published: (slot, batch, layout)
        self._in_flight: tuple[int, PackedBatch, list[TensorSpec]] | None = None
        self.overlap_forwards = self.ring.kind == "cuda"  # a CPU forward is done when it returns: publish at once
        self.validation = ValidationPasses(
            held_out=held_out,
            delivery=self.delivery,
            table=self.table,
            channel=self.channel,
            free_slot=self._free_slot,
            write_slot=self._write_slot,
            ledger=ledger,
            prof=prof,
        )
        self.sessions = ConsumerSessions(
            job=job,
            launch_id=launch_id,
            node=node,
            target=target,
            ring=self.ring,
            channel=self.channel,
            delivery=self.delivery,
            table=self.table,
            validation=self.validation,
            counters=self.counters,
            prof=prof,
        )
        self.ends = StreamEnds(
            transport=t,
            delivery=self.delivery,
            channel=self.channel,
            sessions=self.sessions,
            stop_reason=lambda: self._stop_reason,
        )
        log.info(
            "ring: %s, %d slots × %.1f MiB; control on %s; %d batches planned",
            job.transport_kind,
            t.slots,
            self.ring.slot_bytes / 2**20,
            self.channel.endpoint,
            total_batches,
        )

    # ------------------------------------------------------------------------------------ the loop
    def run(self) -> int:
        self._install_signal_handlers()
        if self.beat:
            self._startup = contextlib.ExitStack()
            self._startup.enter_context(self.beat.phase("first batch", "waiting for consumers, then its forward"))
        try:
            if not self.ends.wait_for_groups():
                return 0 if self._stop_reason else 2  # stopped while waiting is no failure
            said_end = False
            while self._stop_reason is None:
                self.sessions.handle_messages(timeout_s=0)
                if self.ends.finished() and (said_end := self.ends.farewell()):
                    break
                ahead = self._in_flight is not None  # batch n's forward is queued: n+1's goes in behind it
                seq = self.delivery.next_seq_after(self._in_flight[1].seq) if ahead else self.delivery.next_seq()
                if seq is None:  # nothing more to make now: batch n goes out; or a group without members holds us
                    if ahead:
                        self._publish_in_flight()
                    else:
                        self._timed_wait("wait_consumers")
                    continue
                if not ahead:
                    self.validation.run_due()  # a pass a (re)formed group is due before its next batch
                slot = self.table.acquire() if ahead else self._acquire_slot()
                if slot is None:
                    if ahead:  # every other slot is held: batch n goes out, then the usual wait for a slot
                        self._publish_in_flight()
                    continue  # or: stop requested, or the recipients changed while we waited
                batch = self._batch_at(seq)
                layout = self._write_slot(slot, batch)
                if ahead:
                    self._publish_in_flight()
                self._in_flight = (slot, batch, layout)
                if not self.overlap_forwards:
                    self._publish_in_flight()
            if self._in_flight is not None:  # made, never sent: its slot is free again, no cursor moved
                self.table.abort(self._in_flight[0])
                self._in_flight = None
            if not said_end:  # stopped: END with the stop's reason
                self.ends.farewell()
            self._log_done()
            return 1 if self.ends.abandoned else 0
        finally:
            self._end_startup()
            self.close()

    def _end_startup(self) -> None:
        """Leave the start-up phase (its beat thread stops publishing) before this thread publishes."""
        if self._startup is not None:
            self._startup.close()
            self._startup = None
            self.beat.running(self.counters.batches)

    # ------------------------------------------------------------------------------------ stages
    def _batch_at(self, seq: int) -> PackedBatch:
        """The batch for `seq`, from the tokenizer thread's stream; restarts the stream on a jump (replay)."""
        if self._stream is None or self._stream_next != seq:
            log.info("batch stream starts at seq %d", seq)
            if self._stream is not None:
                self._stream.close()  # stops its tokenizer thread
            self._stream = self.batches_from(seq)
        with timed(self.prof, "data"):
            batch = next(self._stream)
        if batch.seq != seq:
            raise RuntimeError(
                f"batch stream gave seq {batch.seq}, expected {seq}: the batch plan is not deterministic"
            )
        self._stream_next = seq + self.delivery.stride
        return batch

    def _write_slot(self, slot: int, batch: PackedBatch) -> list[TensorSpec]:
        tokens, seqs = int(batch.input_ids.shape[0]), int(batch.cu_seqlens.shape[0]) - 1
        layout = slot_layout(tokens, seqs, self.target.feature_width, self.feature_dtype)
        views = self.ring.begin_write(slot, layout)  # the seq tag is invalid from here on
        fp8 = SCALE in views
        with timed(self.prof, "forward"):  # features land in the slot, or in a buffer to quantise from
            features = self.target.forward(
                batch.input_ids,
                batch.cu_seqlens,
                out=self._features_buffer(tokens, views["hidden"].device) if fp8 else views["hidden"],
            )
        with timed(self.prof, "write_slot"):
            if fp8:
                quantize_rows(features, views["hidden"], views[SCALE])
            from_host = {f.name: getattr(batch, f.name) for f in FIELDS if f.name != "hidden"}
            self.ring.end_write(slot, views, from_host, batch.seq)  # queued (CUDA): waited for at its publish
        return layout

    def _publish_in_flight(self) -> None:
        """Send the batch whose forward was queued last, once its writes completed (CUDA: its event, polled
        with a growing delay while messages are served). A batch made ahead that is no longer the next one
        (the groups changed meanwhile) goes back unsent: its slot is freed and it is made again when due."""
        assert self._in_flight is not None
        slot, batch, layout = self._in_flight
        self._in_flight = None
        wait = Backoff()
        while not self.ring.is_written(slot):
            self.sessions.handle_messages(timeout_s=wait.next())
        if batch.seq != self.delivery.next_seq():
            self.table.abort(slot)
            return
        self._publish(slot, batch, layout)
        self._end_startup()
        if self.stats:
            self.stats.maybe_publish(step=self.counters.batches, extra_gauges={"slots_in_use": self.table.in_use})

    def _features_buffer(self, tokens: int, device: torch.device) -> torch.Tensor:
        """The target-dtype rows the forward writes before FP8 quantisation; allocated once at the largest batch."""
        if self._features is None or self._features.shape[0] < tokens:
            rows = max(tokens, self.job.data.tokens_per_batch)
            self._features = torch.empty(rows, self.target.feature_width, dtype=self.target.dtype, device=device)
        return self._features[:tokens]

    def _publish(self, slot: int, batch: PackedBatch, layout: list[TensorSpec]) -> None:
        members = self.delivery.recipients(batch.seq)
        if not members:
            self.table.abort(slot)
            return
        num_loss = int(batch.loss_mask.sum()) if batch.loss_mask.device.type == "cpu" else -1
        wire = layout_to_wire(layout)
        if self.ledger:  # on disk before any consumer can train it: a SIGKILL after the send loses no record
            self.ledger.delivered(
                batch.seq, batch.epoch, batch.sample_ids, [(m.drafter, m.replica, m.epoch) for m in members]
            )
        for m in members:
            self.channel.send(
                m.peer,
                Batch(
                    m.epoch,
                    batch.seq,
                    slot,
                    batch.epoch,
                    wire,
                    list(batch.sample_ids),
                    int(batch.input_ids.shape[0]),
                    num_loss,
                ),
            )
        self.table.publish(slot, batch.seq, [m.peer for m in members])
        self.channel.last_seq = batch.seq
        self.counters.batches += 1
        self.counters.tokens += int(batch.input_ids.shape[0])
        if self.prof:
            self.prof.count("batches")
            self.prof.count("tokens", int(batch.input_ids.shape[0]))
            self.prof.count("sequences", len(batch.sample_ids))
            self.prof.count("loss_tokens", max(num_loss, 0))
        self.validation.run_due()  # before END: the end of the data has its pass
        for g in self.delivery.groups.values():
            if g.ended:
                self.sessions.end_group(g.drafter)

    def _acquire_slot(self) -> int | None:
        """A free slot; waits (back-pressure, timed) while every slot is held by consumers."""
        start = time.perf_counter()
        slot = self._free_slot()
        if self.prof:
            self.prof.add("wait_slot", time.perf_counter() - start)
        if slot is not None and self.delivery.next_seq() is None:
            self.table.abort(slot)  # a group vanished while we waited
            return None
        return slot

    def _free_slot(self) -> int | None:
        """A free slot, waiting (back-pressure: serving messages) while consumers hold every one; None on a stop."""
        slot = self.table.acquire()
        while slot is None and self._stop_reason is None:
            self.sessions.handle_messages(timeout_s=POLL_S)
            slot = self.table.acquire()
        return slot

    # ------------------------------------------------------------------------------------ end
    def _log_done(self) -> None:
        log.info(
            "producer done (%s): %d batches, %d tokens, %d fenced, %d stale messages, %d stale releases,"
            " %d rejected HELLOs",
            self._stop_reason or "data exhausted",
            self.counters.batches,
            self.counters.tokens,
            self.counters.fenced,
            self.counters.stale_messages,
            self.table.stale_releases,
            self.counters.rejected_hellos,
        )

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self.channel.close()
        self.ring.close()
        if self.ledger:
            self.ledger.close()

    # ------------------------------------------------------------------------------------ plumbing
    def _install_signal_handlers(self) -> None:
        def stop(signum, _frame):
            if self._stop_reason is None:  # the first signal says why
                self._stop_reason = stop_reason(signum)

        for sig in STOP_SIGNALS:  # SIGHUP too (a closed SSH session); SIGTERM also when launch.sh dies
            signal.signal(sig, stop)

    def _timed_wait(self, key: str) -> None:
        start = time.perf_counter()
        self.sessions.handle_messages(timeout_s=POLL_S)
        if self.prof:
            self.prof.add(key, time.perf_counter() - start)
