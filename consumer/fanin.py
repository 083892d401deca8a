"""Fan-in: one consumer fed by every producer of its node (target.replicas), one BatchStream each.

Each stream keeps its own control connection, session and ring view (consumer/stream.py); this class only
chooses which one to take the next batch from: whichever has one ready first, scanning round-robin so that
no producer is starved. The batch stream ends when every producer has ended it; losing any producer, or
being refused by one, ends the consumer (the whole job is torn down and resumed by launch.sh).

Seqs are the node's: target replica p makes the seqs p, p + R, p + 2R, ... of one batch plan (producer/
delivery.py), so a seq names its producer (seq mod R) and the group keeps one cursor per producer.
"""

from __future__ import annotations

import time

from consumer.stream import BatchStream, ReceivedBatch, StreamEnd

WAIT_SLICE_S = 0.002  # a blocking wait on one stream before looking at the next


class FanIn:
    def __init__(self, streams: list[BatchStream]):
        self.streams = streams
        self._ended: dict[int, StreamEnd] = {}
        self._next = 0  # round-robin start of the next scan
        self.last_copy_s = 0.0

    def connect(self) -> None:
        for s in self.streams:
            s.connect()

    def next(self, timeout_s: float) -> ReceivedBatch | StreamEnd | None:
        """The next batch from whichever producer has one; StreamEnd once every producer ended; None after
        `timeout_s` without either."""
        deadline = time.monotonic() + timeout_s
        first = True
        while True:
            live = [i for i in range(len(self.streams)) if i not in self._ended]
            if not live:
                last = max(self._ended.values(), key=lambda e: e.last_seq)
                return StreamEnd("; ".join(sorted({e.reason for e in self._ended.values()})), last.last_seq)
            order = live[self._next % len(live) :] + live[: self._next % len(live)]
            for i in order:  # a non-blocking look at each, then a short wait on each in turn
                left = deadline - time.monotonic()
                item = self.streams[i].next(0.0 if first else max(0.0, min(WAIT_SLICE_S, left)))
                if isinstance(item, StreamEnd):
                    self._ended[i] = item
                elif item is not None:
                    self._next = i + 1
                    self.last_copy_s = self.streams[i].last_copy_s
                    return item
            first = False
            if time.monotonic() >= deadline:
                return None

    def bye(self, reason: str, trained_seq: int) -> None:
        for s in self.streams:
            s.bye(reason, trained_seq)

    def close(self) -> None:
        for s in self.streams:
            s.close()
