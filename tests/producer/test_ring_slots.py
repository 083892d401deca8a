"""SlotTable: the producer's slot states, including random operation sequences against a reference model."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from producer.slot_table import SlotTable


def test_slot_cycles_free_writing_published_free():
    table = SlotTable(2)
    slot = table.acquire()
    assert (slot, table.state(slot), table.in_use) == (0, "writing", 1)
    table.publish(slot, seq=7, consumers=["d0", "d1"])
    assert table.state(slot) == "published" and table.pending(slot) == {"d0", "d1"}
    assert table.release("d0", 7, slot)
    assert table.state(slot) == "published" and table.pending(slot) == {"d1"}
    assert table.release("d1", 7, slot)
    assert (table.state(slot), table.in_use, table.stale_releases) == ("free", 0, 0)


def test_acquire_returns_none_when_every_slot_is_busy():
    table = SlotTable(2)
    assert {table.acquire(), table.acquire()} == {0, 1}
    assert table.acquire() is None
    table.abort(1)
    assert table.acquire() == 1


def test_freed_slots_are_reused_in_release_order():
    table = SlotTable(3)
    slots = [table.acquire() for _ in range(3)]
    for seq, slot in enumerate(slots):
        table.publish(slot, seq, ["d0"])
    table.release("d0", 2, 2)
    table.release("d0", 0, 0)
    assert [table.acquire(), table.acquire(), table.acquire()] == [2, 0, None]


@pytest.mark.parametrize(
    "consumer, seq, slot",
    [
        ("d0", 6, 0),  # wrong seq: a release for an earlier use of the slot
        ("d9", 7, 0),  # a consumer the slot was not sent to
        ("d0", 7, 1),  # a slot that is not published
        ("d0", 7, 99),  # no such slot
        ("d0", 7, "0"),  # garbage off the wire
        ("d0", 7, [0]),  # unhashable garbage
        ("d0", 7, True),  # a bool is not a slot
    ],
)
def test_stale_or_unknown_release_is_ignored_and_counted(consumer, seq, slot):
    table = SlotTable(2)
    table.publish(table.acquire(), 7, ["d0"])
    assert not table.release(consumer, seq, slot)
    assert table.stale_releases == 1
    assert table.state(0) == "published" and table.pending(0) == {"d0"}


def test_duplicate_release_is_stale():
    table = SlotTable(1)
    table.publish(table.acquire(), 1, ["d0", "d1"])
    assert table.release("d0", 1, 0)
    assert not table.release("d0", 1, 0)
    assert table.stale_releases == 1 and table.pending(0) == {"d1"}


def test_reclaim_drops_a_fenced_consumer_everywhere():
    table = SlotTable(3)
    a, b, c = (table.acquire() for _ in range(3))
    table.publish(a, 0, ["d0"])
    table.publish(b, 1, ["d0", "d1"])
    table.publish(c, 2, ["d1"])
    assert table.reclaim("d0") == [a]
    assert table.pending(b) == {"d1"} and table.in_use == 2
    assert not table.release("d0", 1, b)  # a late release from the fenced consumer
    assert table.reclaim("d1") == [b, c]
    assert table.in_use == 0 and table.reclaim("d1") == []


def test_publish_misuse_raises():
    table = SlotTable(2)
    with pytest.raises(ValueError, match="not being written"):
        table.publish(0, 0, ["d0"])
    slot = table.acquire()
    with pytest.raises(ValueError, match="no consumer"):
        table.publish(slot, 0, [])
    table.publish(slot, 0, ["d0"])
    with pytest.raises(ValueError, match="not being written"):
        table.publish(slot, 1, ["d0"])


CONSUMERS = ["d0", "d1", "d2"]


class SlotTableMachine(RuleBasedStateMachine):
    """Random acquire/publish/release/reclaim/abort sequences, checked against a plain reference model."""

    def __init__(self):
        super().__init__()
        self.n = 4
        self.table = SlotTable(self.n)
        self.writing: set[int] = set()
        self.published: dict[int, tuple[int, set[str]]] = {}
        self.seq = 0
        self.stale = 0

    @rule()
    def acquire(self):
        slot = self.table.acquire()
        if len(self.writing) + len(self.published) == self.n:
            assert slot is None
        else:
            assert slot is not None and slot not in self.writing and slot not in self.published
            self.writing.add(slot)

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), consumers=st.sets(st.sampled_from(CONSUMERS), min_size=1))
    def publish(self, data, consumers):
        slot = data.draw(st.sampled_from(sorted(self.writing)))
        self.table.publish(slot, self.seq, consumers)
        self.writing.remove(slot)
        self.published[slot] = (self.seq, set(consumers))
        self.seq += 1

    @precondition(lambda self: self.writing)
    @rule(data=st.data())
    def abort(self, data):
        slot = data.draw(st.sampled_from(sorted(self.writing)))
        self.table.abort(slot)
        self.writing.remove(slot)

    @rule(
        consumer=st.sampled_from(CONSUMERS),
        slot=st.integers(-1, 5),
        seq_shift=st.sampled_from([0, 0, 0, -1, 1]),
    )
    def release(self, consumer, slot, seq_shift):
        expected_seq = self.published[slot][0] if slot in self.published else self.seq
        seq = expected_seq + seq_shift
        valid = slot in self.published and seq_shift == 0 and consumer in self.published[slot][1]
        assert self.table.release(consumer, seq, slot) == valid
        if valid:
            pending = self.published[slot][1]
            pending.remove(consumer)
            if not pending:
                del self.published[slot]
        else:
            self.stale += 1

    @rule(consumer=st.sampled_from(CONSUMERS))
    def reclaim(self, consumer):
        freed = []
        for slot, (_seq, pending) in list(self.published.items()):
            pending.discard(consumer)
            if not pending:
                del self.published[slot]
                freed.append(slot)
        assert sorted(self.table.reclaim(consumer)) == sorted(freed)

    @invariant()
    def states_match_the_model(self):
        for slot in range(self.n):
            if slot in self.writing:
                assert self.table.state(slot) == "writing"
            elif slot in self.published:
                assert self.table.state(slot) == "published"
                assert self.table.pending(slot) == self.published[slot][1]
            else:
                assert self.table.state(slot) == "free"
        assert self.table.in_use == len(self.writing) + len(self.published)
        assert self.table.stale_releases == self.stale

    @invariant()
    def no_slot_lost_or_doubled(self):
        free = list(self.table._free)
        assert len(free) == len(set(free)), "a slot was freed twice"
        everything = free + sorted(self.table._writing) + sorted(self.table._published)
        assert sorted(everything) == list(range(self.n)), "a slot was lost or is in two states"


SlotTableMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_slot_table_random_sequences = SlotTableMachine.TestCase
