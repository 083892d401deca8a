"""The sending of evaluation passes (producer/validation_passes.py) against a real Delivery, SlotTable and job
log: the seqs, the BATCH fields, who gets each batch, a group that re-forms at a boundary, a recipient fenced
mid-pass. The e2e test (tests/e2e/test_validation_e2e.py) runs the whole job; this pins what it cannot see."""

from __future__ import annotations

import numpy as np

from common.accounting import DeliveryLedger
from common.accounting_check import read_records
from common.packed_batch import PackedBatch, slot_items
from common.profile import ProfileStats
from common.protocol import Batch
from common.ring import layout_to_wire, plan_layout
from producer.delivery import Delivery
from producer.slot_table import SlotTable
from producer.validation import HeldOut
from producer.validation_passes import ValidationPasses

LENGTHS = {1: 3, 2: 5, 3: 2}  # held-out record → its token count (record i's tokens are all i)


class Records:
    """The held-out records as a dataset's reader gives them: (token ids, loss mask)."""

    def reader(self):
        return self

    def read(self, i: int) -> tuple[list[int], list[int]]:
        return [i] * LENGTHS[i], [0] + [1] * (LENGTHS[i] - 1)

    def close(self) -> None:
        pass


class Wire:
    """The producer's channel as the runner uses it: every send, in order."""

    def __init__(self):
        self.sent: list[tuple[bytes, Batch]] = []

    def send(self, peer: bytes, msg: Batch) -> None:
        self.sent.append((peer, msg))


def layout_of(slot: int, batch: PackedBatch):
    return plan_layout(slot_items(batch.num_tokens, batch.num_sequences, 4, "float32"))


def attach(delivery: Delivery, passes: ValidationPasses, peer: bytes, drafter: str, replica: int, resume: int = 0):
    m = delivery.join(peer, drafter, replica, pid=1, resume_seq=resume)
    delivery.attach(peer, m.epoch)
    if len(delivery.groups[drafter].live()) == 1:  # as the producer loop does
        passes.group_formed(drafter, delivery.groups[drafter].cursor)
    return m


def runner(tmp_path, write_slot=None):
    held = HeldOut("split", Records(), np.array([1, 2, 3]), ((2, 1), (3,)), eval_every=4)
    delivery, table, wire, prof = Delivery(["a", "b"], total_batches=10), SlotTable(3), Wire(), ProfileStats()
    ledger = DeliveryLedger(tmp_path, 0, 10, [10], range(10))
    written: list[tuple[int, int, list[int]]] = []

    def free_slot() -> int | None:  # back-pressure: while every slot is held, the consumers' RELEASEs come in
        slot = table.acquire()
        if slot is None:
            release_all(table, wire)
            slot = table.acquire()
        return slot

    def write(slot: int, batch: PackedBatch):
        written.append((slot, batch.seq, batch.input_ids.tolist()))
        return (write_slot or layout_of)(slot, batch)

    passes = ValidationPasses(
        held_out=held,
        delivery=delivery,
        table=table,
        channel=wire,
        free_slot=free_slot,
        write_slot=write,
        ledger=ledger,
        prof=prof,
    )
    return passes, delivery, table, wire, written, ledger


def release_all(table: SlotTable, wire: Wire) -> None:
    for peer, msg in wire.sent:
        table.release(peer, msg.seq, msg.slot)  # one already released counts as stale, changes nothing


def test_passes_take_seqs_minus_two_on_go_to_each_groups_lowest_replica_and_re_run_at_a_re_formed_boundary(tmp_path):
    passes, delivery, table, wire, written, ledger = runner(tmp_path)
    a0 = attach(delivery, passes, b"a0", "a", 0)
    attach(delivery, passes, b"a1", "a", 1)
    b0 = attach(delivery, passes, b"b0", "b", 0)
    passes.run_due()
    assert wire.sent == []  # no pass is due at seq 0
    for seq in range(4):
        delivery.recipients(seq)
    passes.run_due()  # both cursors at 4 = eval_every: pass 1 for both, one forward per batch
    assert written == [(0, -2, [2] * 5 + [1] * 3), (1, -3, [3] * 2)]
    first = [(p, m.seq, m.slot, m.data_epoch, m.sample_ids, m.num_tokens, m.num_loss_tokens) for p, m in wire.sent]
    assert first == [
        (b"a0", -2, 0, 0, [2, 1], 8, 6),
        (b"b0", -2, 0, 0, [2, 1], 8, 6),
        (b"a0", -3, 1, 0, [3], 2, 1),
        (b"b0", -3, 1, 0, [3], 2, 1),
    ]
    assert [(m.epoch, m.val_pass, m.val_index, m.val_count) for _, m in wire.sent] == [
        (a0.epoch, 1, 0, 2),
        (b0.epoch, 1, 0, 2),
        (a0.epoch, 1, 1, 2),
        (b0.epoch, 1, 1, 2),
    ]
    assert wire.sent[0][1].layout == layout_to_wire(plan_layout(slot_items(8, 2, 4, "float32")))
    assert b"a1" not in {p for p, _ in wire.sent} and table.in_use == 2
    assert (table.pending(0), table.pending(1)) == ({b"a0", b"b0"}, {b"a0", b"b0"})
    release_all(table, wire)
    passes.run_due()
    assert len(wire.sent) == 4  # pass 1 was had

    first_b = b0.epoch
    delivery.leave(b"b0")  # b restarts from its checkpoint at seq 4, the boundary: pass 1 may not have run
    b0 = attach(delivery, passes, b"b0", "b", 0, resume=4)
    wire.sent.clear()
    passes.run_due()
    assert [(p, m.seq, m.val_pass, m.val_index, m.epoch) for p, m in wire.sent] == [
        (b"b0", -4, 1, 0, b0.epoch),
        (b"b0", -5, 1, 1, b0.epoch),
    ]
    release_all(table, wire)
    wire.sent.clear()
    for seq in range(4, 10):  # the loop: a batch, then whatever pass is due
        delivery.recipients(seq)
        passes.run_due()
    # pass 2 at cursor 8, pass 3 at the end of the data (10 batches); its second batch waits for a RELEASE
    got = [(m.seq, m.val_pass, m.slot) for _, m in wire.sent]
    assert got == [(-6, 2, 1)] * 2 + [(-7, 2, 2)] * 2 + [(-8, 3, 0)] * 2 + [(-9, 3, 1)] * 2
    assert passes.sent == 8 and passes.prof.snapshot()["counters"] == {"val_batches": 8, "val_tokens": 40}
    ledger.close()
    records = [r for r in read_records([tmp_path])[0] if r["kind"] == "validation"]
    assert [(r["pass"], r["index"], r["samples"], r["to"]) for r in records[:2]] == [
        (1, 0, [2, 1], [["a", 0, a0.epoch], ["b", 0, first_b]]),
        (1, 1, [3], [["a", 0, a0.epoch], ["b", 0, first_b]]),
    ]
    assert [(r["pass"], r["to"]) for r in records[2:4]] == [(1, [["b", 0, b0.epoch]])] * 2
    assert [r["pass"] for r in records[4:]] == [2, 2, 3, 3]


def test_a_pass_whose_recipients_are_all_fenced_mid_write_stops_and_frees_its_slot(tmp_path):
    def fence_during_write(slot, batch):
        delivery.leave(b"a0")  # the producer handles messages while the forward runs: a0 was fenced meanwhile
        return layout_of(slot, batch)

    passes, delivery, table, wire, written, ledger = runner(tmp_path, fence_during_write)
    attach(delivery, passes, b"a0", "a", 0)
    for seq in range(4):
        delivery.recipients(seq)
    passes.run_due()
    assert [seq for _, seq, _ in written] == [-2] and wire.sent == [] and table.in_use == 0
    assert passes.sent == 0 and passes.done == {"a": 1}  # the pass counts as had: no retry at every batch
    assert "validation" not in passes.prof.snapshot()["timers"]  # a pass cut short is not timed or logged
    ledger.close()
    assert [r for r in read_records([tmp_path])[0] if r["kind"] == "validation"] == []
