"""Who receives which batch: consumer groups (one per drafter), their members (replicas) and cursors.

Every batch goes to one live member of every group (round-robin within the group). Each group has a
cursor, the next seq it needs; the producer always makes the batch at the smallest cursor, so a group
that comes back from a checkpoint is replayed the batches it lost while groups that are ahead wait —
nothing is trained twice or skipped by any drafter.

A session that ends while it holds batches it never released (fenced, or replaced by a HELLO of the same
consumer) leaves them as orphans: a consumer releases a slot exactly when it keeps the batch, so those
were not trained. When the same process attaches again (it stalled past the heartbeat bound, or saw a
slot reused) they are made again for its group (`replay`), whatever the group's cursor: a replica that
re-attaches behind its group catches up instead of waiting for batches that went past it. A group with
orphans has not ended.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
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
    reattached: bool = False  # the HELLO said the process already holds the ring: the same process again
    attached: bool = False
    batches: int = 0
    told_end: bool = False  # END was sent to this session: it is sent no more batches
    formed: bool = False  # its attachment (re)formed the group at its resume seq


@dataclass
class Orphans:
    """Training seqs a session held unreleased when it ended (so never trained), by the process that held them."""

    replica: int
    pid: int
    seqs: set[int]


@dataclass
class Group:
    drafter: str
    members: dict[bytes, Member] = field(default_factory=dict)
    cursor: int | None = None  # next seq this group needs; None until a member attaches
    next_member: int = 0  # round-robin position
    ended: bool = False
    replay: set[int] = field(default_factory=set)  # seqs below the cursor to make again (a session lost them)
    orphans: dict[int, Orphans] = field(default_factory=dict)  # by the epoch of the session that left them

    def live(self) -> list[Member]:
        return sorted((m for m in self.members.values() if m.attached), key=lambda m: m.replica)

    def needs(self) -> int | None:
        """The lowest seq this group needs next, None when it needs none now."""
        if self.cursor is None:
            return None
        return min(self.replay, default=self.cursor)

    def update_ended(self, total_batches: int) -> None:
        self.ended = self.cursor is not None and self.cursor >= total_batches and not self.replay and not self.orphans


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
    def join(
        self,
        peer: bytes,
        drafter: str,
        replica: int,
        pid: int,
        resume_seq: int,
        *,
        reattached: bool = False,
        unreleased: Iterable[int] = (),
    ) -> Member:
        """A HELLO. A previous session of the same peer is replaced; `unreleased`: the seqs that session held
        unreleased (the caller reclaims its slots); `reattached`: the HELLO says its process holds the ring."""
        if drafter not in self.groups:
            raise KeyError(f"no drafter {drafter!r} in this job (have {sorted(self.groups)})")
        self.leave(peer, unreleased)
        member = Member(peer, drafter, replica, pid, next(self._epochs), resume_seq, reattached)
        self.groups[drafter].members[peer] = member
        self.by_peer[peer] = member
        return member

    def attach(self, peer: bytes, epoch: int) -> Member | None:
        member = self.by_peer.get(peer)
        if member is None or member.epoch != epoch:
            return None
        group = self.groups[member.drafter]
        if member.reattached and group.cursor is not None:
            # the same process again, its training state intact: only what its ended sessions held unreleased
            # is lost (never trained); the group's cursor stays, whether or not another member is live
            for e in [e for e, o in group.orphans.items() if o.replica == member.replica and o.pid == member.pid]:
                group.replay |= group.orphans.pop(e).seqs
        elif not group.live():
            # the group (re)forms: it resumes where its checkpoint says, replaying what it lost in a crash
            # (every seq from there is made again: the orphans of its dead processes with them)
            group.cursor = min(self.first_from(member.resume_seq), self.total_batches)
            group.replay.clear()
            group.orphans.clear()
            member.formed = True
        # else: a member joining a running group joins its stream where it is
        group.update_ended(self.total_batches)
        member.attached = True
        return member

    def first_from(self, seq: int) -> int:
        """This producer's first seq at or after `seq`."""
        seq = max(seq, 0)
        return seq + (self.offset - seq) % self.stride

    def leave(self, peer: bytes, unreleased: Iterable[int] = ()) -> Member | None:
        """A session ends (fence, BYE, replaced); `unreleased`: the seqs it held unreleased (orphans)."""
        member = self.by_peer.pop(peer, None)
        if member is not None:
            group = self.groups[member.drafter]
            group.members.pop(peer, None)
            seqs = {s for s in unreleased if s >= 0}  # validation batches (negative tags) are not the plan's
            if seqs and group.cursor is not None:
                group.orphans[member.epoch] = Orphans(member.replica, member.pid, seqs)
                group.update_ended(self.total_batches)
        return member

    def released_late(self, epoch: int, seqs: Iterable[int]) -> None:
        """A RELEASE of a session already ended: the consumer kept those batches, they are no orphans."""
        for g in self.groups.values():
            if epoch in g.orphans:
                g.orphans[epoch].seqs.difference_update(seqs)
                if not g.orphans[epoch].seqs:
                    del g.orphans[epoch]
                g.update_ended(self.total_batches)

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
        needed = [g.needs() for g in self.groups.values() if not g.ended and self._dealable(g)]
        needed = [s for s in needed if s is not None and s < self.total_batches]
        return min(needed) if needed else None

    @staticmethod
    def _dealable(g: Group) -> list[Member]:
        """The live members that may be sent a batch (not yet told the stream ended)."""
        return [m for m in g.live() if not m.told_end]

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
        """One live member of every group that needs `seq`; advances those groups' cursors (or takes `seq` off
        their replay)."""
        chosen = []
        for g in self.groups.values():
            live = self._dealable(g)
            if g.ended or not live:
                continue
            if seq in g.replay:
                g.replay.discard(seq)
            elif g.cursor == seq:
                g.cursor += self.stride
            else:
                continue
            g.update_ended(self.total_batches)
            member = live[g.next_member % len(live)]
            g.next_member += 1
            member.batches += 1
            chosen.append(member)
        return chosen

    def finished(self) -> bool:
        """Every group has all its batches, or (skip mode) is gone and would not be waited for."""
        skip = self.on_dead_group == "skip"
        return all(g.ended or (skip and not g.live()) for g in self.groups.values())

    def newly_ended_members(self) -> list[Member]:
        return [m for g in self.groups.values() if g.ended for m in g.live()]
