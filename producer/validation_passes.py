"""The sending of evaluation passes: producer/validation.py says what a pass holds and when it is due; this
module writes each batch of a due pass into a ring slot with the same target forward and the same
back-pressure as a training batch, and sends it to the lowest live replica of every group due that pass.

The producer loop (producer/service.py) calls `run_due()` where a pass may be due (before each training
batch, and after each one it publishes so that the end of the data has its pass before END) and
`group_formed()` when a group (re)forms; what it needs (the groups, the slot table, the channel, the job log,
the back-pressure wait and the slot write) is handed in once, at construction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from common.accounting import DeliveryLedger
from common.channel import ProducerChannel
from common.packed_batch import PackedBatch
from common.profile import ProfileStats
from common.protocol import Batch
from common.ring import TensorSpec, layout_to_wire
from producer.delivery import Delivery
from producer.slot_table import SlotTable
from producer.validation import HeldOut

log = logging.getLogger("producer")


@dataclass(eq=False, repr=False, kw_only=True)
class ValidationPasses:
    """The evaluation passes one producer runs: which each group had, and the seqs their batches take."""

    held_out: HeldOut | None  # the validation records (None, or eval_every 0: no passes, every call a no-op)
    delivery: Delivery  # the groups, their cursors and live members
    table: SlotTable
    channel: ProducerChannel
    free_slot: Callable[[], int | None]  # a slot, waiting under back-pressure (serving messages); None: stopping
    write_slot: Callable[[int, PackedBatch], list[TensorSpec]]  # the target forward into a slot; its layout
    ledger: DeliveryLedger | None = None  # each batch is recorded there before it is sent (common/accounting.py)
    prof: ProfileStats | None = None
    batches: list[PackedBatch] = field(init=False)  # one pass, the same every pass
    done: dict[str, int] = field(init=False, default_factory=dict)  # per drafter: the passes its group had
    seq: int = field(init=False, default=-1)  # batches take seqs -2, -3, ... (-1 marks a slot being written)
    sent: int = field(init=False, default=0)  # validation batches sent

    def __post_init__(self) -> None:
        if self.held_out is not None and not self.held_out.eval_every:
            self.held_out = None
        self.batches = self.held_out.packed() if self.held_out else []

    def group_formed(self, drafter: str, cursor: int) -> None:
        """A group (re)formed at `cursor`: passes due below it were had; one due at the cursor itself may not
        have been evaluated (a consumer stalled or restarted right after its boundary): it runs again."""
        if self.held_out:
            self.done[drafter] = self.held_out.passes_at(max(cursor - 1, 0), self.delivery.total_batches)

    def run_due(self) -> None:
        """Run the passes the groups reached (producer/validation.py says when); groups due the same pass
        share its forwards. Each batch goes to the lowest live replica of each such group."""
        if self.held_out is None:
            return
        due: dict[int, list[str]] = {}
        for g in self.delivery.groups.values():
            if g.cursor is not None and g.live():
                k = self.held_out.passes_at(g.cursor, self.delivery.total_batches)
                if k > self.done.get(g.drafter, 0):
                    due.setdefault(k, []).append(g.drafter)
        for k, drafters in sorted(due.items()):
            self._run_pass(k, drafters)

    def _run_pass(self, k: int, drafters: list[str]) -> None:
        start = time.perf_counter()
        for d in drafters:
            self.done[d] = k
        members = [self.delivery.groups[d].live()[0] for d in drafters]
        count, tokens = len(self.batches), 0
        for i, held in enumerate(self.batches):
            slot = self.free_slot()
            if slot is None:
                return  # stopping
            self.seq -= 1
            batch = replace(held, seq=self.seq)
            layout = self.write_slot(slot, batch)
            live = [m for m in members if self.delivery.by_peer.get(m.peer) is m and m.attached]
            if not live:  # every recipient was fenced meanwhile
                self.table.abort(slot)
                return
            if self.ledger:
                self.ledger.validated(k, i, batch.sample_ids, [(m.drafter, m.replica, m.epoch) for m in live])
            wire, ids = layout_to_wire(layout), list(batch.sample_ids)
            T, num_loss = batch.num_tokens, int(batch.loss_mask.sum())
            for m in live:
                self.channel.send(m.peer, Batch(m.epoch, batch.seq, slot, 0, wire, ids, T, num_loss, k, i, count))
            self.table.publish(slot, batch.seq, [m.peer for m in live])
            self.sent += 1
            tokens += T
            if self.prof:
                self.prof.count("val_batches")
                self.prof.count("val_tokens", T)
        elapsed = time.perf_counter() - start
        if self.prof:
            self.prof.add("validation", elapsed)
        log.info(
            "validation pass %d for %s: %d batches, %d tokens in %.2f s", k, ", ".join(drafters), count, tokens, elapsed
        )
