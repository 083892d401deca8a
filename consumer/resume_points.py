"""Where a drafter replica asks each producer to resume (the seq its HELLO carries): the group's cursor for
that producer, past what this replica trained from it since. The streams ask it on every (re)attachment;
the service advances it as it trains and checkpoints. Made before both, so neither refers to the other."""

from __future__ import annotations

from consumer.group_cursor import GroupCursor


class ResumePoints:
    def __init__(self, cursor: GroupCursor, node: int):
        self.cursor = cursor
        self.node = node
        self.highest_seen: dict[int, int] = {}  # per producer: the highest seq trained since the start

    def seq(self, producer: int = 0) -> int:
        """The seq this replica asks `producer` for: a producer resumes at its first seq from there."""
        return max(self.cursor.cursors[self.node][producer], self.highest_seen.get(producer, -1) + 1)

    def saw(self, seq: int) -> None:
        """This replica trained `seq` (from producer seq % producers)."""
        p = seq % self.cursor.producers
        self.highest_seen[p] = max(self.highest_seen.get(p, -1), seq)
