"""The producer's consumer sessions: the control messages (HELLO, ATTACHED, RELEASE, BYE, FAIL, a lost peer)
turned into group membership (producer/delivery.py) and slot-table changes (producer/slot_table.py), and the END
sent to a group's members once it has all its batches.

The loop (producer/service.py) calls `handle_messages` wherever it waits, so every wait serves the consumers;
a HELLO that does not belong to this job's node and launch is refused before it touches any state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from common.channel import PeerLost, ProducerChannel, Received
from common.config import JobConfig
from common.profile import ProfileStats
from common.protocol import DATA_EXHAUSTED, Attached, Bye, End, Fail, Hello, Release, Welcome
from common.ring import SlotRing
from producer.delivery import Delivery
from producer.slot_table import SlotTable
from producer.target import TargetCapture
from producer.tp import LeaderTarget
from producer.validation_passes import ValidationPasses

log = logging.getLogger("producer")

POLL_S = 0.05  # one wait for messages: the loop's waits are made of these


@dataclass
class ProducerCounters:
    """What the producer's done line reports: the loop counts batches and tokens, the sessions the rest."""

    batches: int = 0
    tokens: int = 0
    stale_messages: int = 0
    fenced: int = 0
    rejected_hellos: int = 0  # HELLOs that do not fit the job (drafter, replica, node, launch)


@dataclass(eq=False, repr=False, kw_only=True)
class ConsumerSessions:
    """The consumers one producer serves; what the messages change is handed in once, at construction."""

    job: JobConfig
    launch_id: str  # the launch every HELLO must carry (common/joblock.py)
    node: int  # the node rank every HELLO must name
    target: TargetCapture  # a tensor-parallel leader's followers are kept alive while messages are served
    ring: SlotRing  # its kind, size and export go out in WELCOME
    channel: ProducerChannel
    delivery: Delivery
    table: SlotTable
    validation: ValidationPasses  # told when a group (re)forms
    counters: ProducerCounters
    prof: ProfileStats | None = None

    def handle_messages(self, timeout_s: float) -> None:
        """Serve what arrives within `timeout_s`, then whatever else is queued."""
        if isinstance(self.target, LeaderTarget):
            self.target.keepalive()  # a tensor-parallel group's followers wait for rank 0 with a timeout
        deadline = time.monotonic() + timeout_s
        while True:
            ev = self.channel.recv(max(0.0, deadline - time.monotonic()))
            if ev is None:
                return
            if isinstance(ev, PeerLost):
                self._fence(ev.peer, ev.reason)
            else:
                self._on_message(ev)
            deadline = time.monotonic()  # drain whatever else is queued, then return

    def end_group(self, drafter: str) -> None:
        """END (data exhausted) to each live member of a group that has all its batches, once."""
        for m in self.delivery.groups[drafter].live():
            if not m.told_end:
                self.channel.send(m.peer, End(DATA_EXHAUSTED, self.delivery.total_batches - 1))
                m.told_end = True

    def _on_message(self, ev: Received) -> None:
        msg, peer = ev.msg, ev.peer
        if isinstance(msg, Hello):
            self._on_hello(peer, msg)
        elif isinstance(msg, Attached):
            member = self.delivery.attach(peer, msg.epoch)
            if member is None:
                self._stale(peer, msg)
            else:
                group = self.delivery.groups[member.drafter]
                log.info(
                    "%s.r%d (pid %d) attached; its group resumes at seq %s%s",
                    member.drafter,
                    member.replica,
                    member.pid,
                    group.cursor,
                    f", seqs {sorted(group.replay)} made again (never trained)" if group.replay else "",
                )
                if member.formed:  # the group (re)formed at this member's resume seq
                    self.validation.group_formed(member.drafter, group.cursor)
                if group.ended:  # nothing left for it (it may re-attach after the group's END)
                    self.end_group(member.drafter)
                if member.resume_seq > self.delivery.total_batches:  # data.epochs lowered below what it trained
                    log.warning(
                        "%s resumes at seq %d, past the end of this plan (%d batches, data.epochs = %d): its"
                        " checkpoint trained more epochs than the job now asks for; nothing is left to train"
                        " for it",
                        member.drafter,
                        member.resume_seq,
                        self.delivery.total_batches,
                        self.job.data.epochs,
                    )
        elif isinstance(msg, Release):
            if self.delivery.member(peer, msg.epoch) is None:
                # a session that ended (fenced) kept these batches after all: they are no orphans
                self.delivery.released_late(msg.epoch, [seq for seq, _slot in msg.pairs])
                self._stale(peer, msg)
                return
            for seq, slot in msg.pairs:
                self.table.release(peer, seq, slot)
        elif isinstance(msg, Bye):
            member = self.delivery.leave(peer)
            self.table.reclaim(peer)
            self.channel.forget(peer)
            if member:
                log.info(
                    "%s.r%d said bye (%s, trained through seq %d)",
                    member.drafter,
                    member.replica,
                    msg.reason,
                    msg.trained_seq,
                )
        elif isinstance(msg, Fail):
            log.error("consumer %r failed: %s", peer, msg.reason)
            self._fence(peer, f"reported failure: {msg.reason}")
        else:
            self._stale(peer, msg)

    def _hello_problem(self, msg: Hello) -> str | None:
        """Why a HELLO does not belong to this job's node and launch; None when it does."""
        if msg.launch != self.launch_id:
            return (
                f"launch {msg.launch or '(none)'} is not this producer's launch {self.launch_id or '(none)'}:"
                " another launch of the same job?"
            )
        if msg.node != self.node:
            return f"node {msg.node}: this producer serves node {self.node}"
        drafter = next((d for d in self.job.drafters if d.name == msg.drafter), None)
        if drafter is None:
            return f"no drafter {msg.drafter!r} in this job (have {[d.name for d in self.job.drafters]})"
        if not 0 <= msg.replica < drafter.replicas:
            return f"replica {msg.replica} is outside drafter {drafter.name}'s {drafter.replicas} replica(s)"
        return None

    def _on_hello(self, peer: bytes, msg: Hello) -> None:
        problem = self._hello_problem(msg)
        if problem is not None:  # refused before it can touch any state (slots, groups, cursors)
            self.counters.rejected_hellos += 1
            if self.prof:
                self.prof.count("rejected_hellos")
            log.warning("rejected HELLO from %r (pid %d): %s", peer, msg.pid, problem)
            self.channel.send(peer, Fail(f"rejected: {problem}", fatal=True))
            self.channel.forget(peer)
            return
        # a previous session of this consumer holds nothing any more: what it held unreleased it never trained
        unreleased = self.table.held_by(peer)
        self.table.reclaim(peer)
        member = self.delivery.join(
            peer,
            msg.drafter,
            msg.replica,
            msg.pid,
            msg.resume_seq,
            reattached=msg.ring_attached,
            unreleased=unreleased,
        )
        t = self.job.transport
        # a CUDA export must be opened exactly once: a process that holds the ring gets none
        handle = {} if msg.ring_attached else self.ring.handle()
        self.channel.send(
            peer,
            Welcome(
                member.epoch,
                self.ring.kind,
                self.ring.num_slots,
                self.ring.slot_bytes,
                handle,
                t.heartbeat_interval_s,
                t.heartbeat_timeout_s,
                self.launch_id,
            ),
        )

    def _fence(self, peer: bytes, reason: str) -> None:
        member = self.delivery.leave(peer, self.table.held_by(peer))
        freed = self.table.reclaim(peer)
        self.channel.forget(peer)
        if member:
            self.counters.fenced += 1
            if self.prof:
                self.prof.count("fenced")
            log.warning(
                "fenced %s.r%d (pid %d): %s; reclaimed slots %s",
                member.drafter,
                member.replica,
                member.pid,
                reason,
                freed,
            )

    def _stale(self, peer: bytes, msg: object) -> None:
        """A message from a session we no longer know (fenced, replaced): ignore it, tell the sender."""
        self.counters.stale_messages += 1
        if self.prof:
            self.prof.count("stale_messages")
        self.channel.send(peer, Fail("fenced: unknown session, send HELLO again", fatal=False))
