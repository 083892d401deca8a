"""The producer's slot bookkeeping, kept apart from the memory it describes (pure Python)."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable


class SlotTable:
    """The producer's slot bookkeeping: FREE → WRITING → PUBLISHED(pending consumers) → FREE.

    A slot returns to FREE only when every consumer it was sent to released it (or was fenced). Releases
    come off the wire, so a stale or unknown one is ignored and counted, never trusted.
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._writing: set[int] = set()
        self._published: dict[int, tuple[int, set[Hashable]]] = {}  # slot -> (seq, pending consumers)
        self.stale_releases = 0

    @property
    def in_use(self) -> int:
        return self.num_slots - len(self._free)

    def acquire(self) -> int | None:
        """A FREE slot, now WRITING; None when all are busy (the caller waits: back-pressure)."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._writing.add(slot)
        return slot

    def abort(self, slot: int) -> None:
        """A WRITING slot that will not be published (write failed, nobody to send to) goes back FREE."""
        self._writing.remove(slot)
        self._free.append(slot)

    def publish(self, slot: int, seq: int, consumers: Iterable[Hashable]) -> None:
        pending = set(consumers)
        if slot not in self._writing:
            raise ValueError(f"publish of slot {slot}, which is not being written")
        if not pending:
            raise ValueError(f"publish of slot {slot} to no consumer; abort() it instead")
        self._writing.remove(slot)
        self._published[slot] = (seq, pending)

    def release(self, consumer: Hashable, seq: object, slot: object) -> bool:
        """True when this release was expected; a stale, duplicate or unknown one is counted and ignored."""
        entry = self._published.get(slot) if type(slot) is int else None
        if entry is None or entry[0] != seq or consumer not in entry[1]:
            self.stale_releases += 1
            return False
        entry[1].discard(consumer)
        if not entry[1]:
            del self._published[slot]
            self._free.append(slot)
        return True

    def held_by(self, consumer: Hashable) -> list[int]:
        """The seqs of the published slots `consumer` has not released (the batches it was sent and not kept)."""
        return sorted(seq for seq, pending in self._published.values() if consumer in pending)

    def reclaim(self, consumer: Hashable) -> list[int]:
        """Forget a fenced consumer everywhere; returns the slots that became FREE."""
        freed = []
        for slot, (_seq, pending) in list(self._published.items()):
            pending.discard(consumer)
            if not pending:
                del self._published[slot]
                self._free.append(slot)
                freed.append(slot)
        return freed

    def state(self, slot: int) -> str:
        if slot in self._writing:
            return "writing"
        return "published" if slot in self._published else "free"

    def pending(self, slot: int) -> frozenset:
        entry = self._published.get(slot)
        return frozenset(entry[1]) if entry else frozenset()
