"""Who receives which batch: consumer groups (one per drafter), their members (replicas) and cursors.

Every batch goes to one live member of every group (round-robin within the group). Each group has a
cursor, the next seq it needs; the producer always makes the batch at the smallest cursor, so a group
that comes back from a checkpoint is replayed the batches it lost while groups that are ahead wait —
nothing is trained twice or skipped by any drafter.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Member:
    peer: bytes
    drafter: str
    replica: int
    pid: int
    epoch: int  # session number: messages carrying another epoch are stale
    resume_seq: int
    attached: bool = False
    batches: int = 0


@dataclass
class Group:
    drafter: str
    members: dict[bytes, Member] = field(default_factory=dict)
    cursor: int | None = None  # next seq this group needs; None until a member attaches
    next_member: int = 0  # round-robin position
    ended: bool = False

    def live(self) -> list[Member]:
        return sorted((m for m in self.members.values() if m.attached), key=lambda m: m.replica)


class Delivery:
    def __init__(
        self,
        drafters: list[str],
        total_batches: int,
        on_dead_group: Literal["block", "skip"] = "block",
        *,
        stride: int = 1,
        offset: int = 0,
    ):
        """`stride`, `offset`: this producer makes the seqs offset, offset + stride, ... of the node's plan
        (target replica `offset` of `stride`; the other seqs are the other replicas')."""
        self.groups = {d: Group(d) for d in drafters}
        self.total_batches = total_batches
        self.stride = stride
        self.offset = offset
        self.on_dead_group = on_dead_group
        self._epochs = itertools.count(1)
        self.by_peer: dict[bytes, Member] = {}

    # ---------------------------------------------------------------- membership
    def join(self, peer: bytes, drafter: str, replica: int, pid: int, resume_seq: int) -> Member:
        """A HELLO. A previous session of the same peer is replaced (the caller reclaims its slots first)."""
        if drafter not in self.groups:
            raise KeyError(f"no drafter {drafter!r} in this job (have {sorted(self.groups)})")
        self.leave(peer)
        member = Member(peer, drafter, replica, pid, next(self._epochs), resume_seq)
        self.groups[drafter].members[peer] = member
        self.by_peer[peer] = member
        return member

    def attach(self, peer: bytes, epoch: int) -> Member | None:
        member = self.by_peer.get(peer)
        if member is None or member.epoch != epoch:
            return None
        group = self.groups[member.drafter]
        if not group.live():
            # the group (re)forms: it resumes where its checkpoint says, replaying what it lost in a crash;
            # a member joining a running group joins its stream where it is
            group.cursor = min(self.first_from(member.resume_seq), self.total_batches)
            group.ended = group.cursor >= self.total_batches
        member.attached = True
        return member

    def first_from(self, seq: int) -> int:
        """This producer's first seq at or after `seq`."""
        seq = max(seq, 0)
        return seq + (self.offset - seq) % self.stride

    def leave(self, peer: bytes) -> Member | None:
        member = self.by_peer.pop(peer, None)
        if member is not None:
            self.groups[member.drafter].members.pop(peer, None)
        return member

    def member(self, peer: bytes, epoch: int) -> Member | None:
        m = self.by_peer.get(peer)
        return m if m is not None and m.epoch == epoch else None

    # ---------------------------------------------------------------- scheduling
    def waiting_for(self) -> list[str]:
        """Groups that hold the producer back: unfinished, without a live member, in block mode."""
        if self.on_dead_group != "block":
            return []
        return [g.drafter for g in self.groups.values() if not g.ended and not g.live()]

    def next_seq(self) -> int | None:
        """The seq to make next, or None when nothing can be sent now (all done, or a group is missing)."""
        if self.waiting_for():
            return None
        cursors = [g.cursor for g in self.groups.values() if not g.ended and g.live() and g.cursor is not None]
        return min(cursors) if cursors else None

    def next_seq_after(self, seq: int) -> int | None:
        """What next_seq() will give once `seq` went to the groups that need it now, membership unchanged: the
        producer enqueues that batch's forward before it publishes `seq` (checked against next_seq() then)."""
        if self.waiting_for():
            return None
        cursors = []
        for g in self.groups.values():
            if g.ended or not g.live() or g.cursor is None:
                continue
            cursor = g.cursor + self.stride if g.cursor == seq else g.cursor
            if cursor < self.total_batches:
                cursors.append(cursor)
        return min(cursors) if cursors else None

    def recipients(self, seq: int) -> list[Member]:
        """One live member of every group that needs `seq`; advances those groups' cursors."""
        chosen = []
        for g in self.groups.values():
            live = g.live()
            if g.ended or not live or g.cursor != seq:
                continue
            member = live[g.next_member % len(live)]
            g.next_member += 1
            g.cursor += self.stride
            g.ended = g.cursor >= self.total_batches
            member.batches += 1
            chosen.append(member)
        return chosen

    def finished(self) -> bool:
        """Every group has all its batches, or (skip mode) is gone and would not be waited for."""
        skip = self.on_dead_group == "skip"
        return all(g.ended or (skip and not g.live()) for g in self.groups.values())

    def newly_ended_members(self) -> list[Member]:
        return [m for g in self.groups.values() if g.ended for m in g.live()]
