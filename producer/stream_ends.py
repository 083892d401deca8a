"""The two ends of the producer's batch stream: the wait for every drafter group before the first batch, the
decision that the stream is over (skip mode: with a grace for groups that are only restarting), and the
farewell (END to every consumer, then a bounded wait for their releases and BYEs).

The loop (producer/service.py) asks these at its start and on each turn; each wait serves the consumers'
messages (producer/sessions.py) and ends early on a stop, which `stop_reason` reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.channel import ProducerChannel
from common.config import TransportConfig
from common.protocol import DATA_EXHAUSTED, End
from producer.delivery import Delivery
from producer.sessions import POLL_S, ConsumerSessions

log = logging.getLogger("producer")


@dataclass(eq=False, repr=False, kw_only=True)
class StreamEnds:
    """Whether the stream may start and whether it is over, for one producer's groups."""

    transport: TransportConfig  # attach_timeout_s, on_dead_group, heartbeat_timeout_s
    delivery: Delivery
    channel: ProducerChannel
    sessions: ConsumerSessions
    stop_reason: Callable[[], str | None]  # why the producer was told to stop; None while it runs
    abandoned: list[str] = field(init=False, default_factory=list)  # groups the job ended without (skip mode)
    _unattended_since: float | None = field(init=False, default=None)  # skip mode: since when no group is served

    def wait_for_groups(self) -> bool:
        """Every group needs an attached member before the first batch (skip mode: as many as came in time)."""
        deadline = time.monotonic() + self.transport.attach_timeout_s
        last_note = 0.0
        while self.stop_reason() is None:
            self.sessions.handle_messages(timeout_s=POLL_S)
            missing = [g.drafter for g in self.delivery.groups.values() if not g.live()]
            if not missing:
                return True
            now = time.monotonic()
            if now > deadline:
                if self.transport.on_dead_group == "skip" and len(missing) < len(self.delivery.groups):
                    log.warning("starting without drafter group(s) %s (on_dead_group = skip)", missing)
                    return True
                log.error(
                    "no consumer attached for drafter(s) %s within transport.attach_timeout_s = %.0f s",
                    missing,
                    self.transport.attach_timeout_s,
                )
                return False
            if now - last_note > 10:
                log.info("waiting for consumers of %s", missing)
                last_note = now
        return False

    def finished(self) -> bool:
        """Every group has all its batches; or (skip mode) every unfinished group is gone and none came back
        within transport.attach_timeout_s. Skip mode must not end the job just because every consumer is
        restarting at the same moment: their groups would never get the rest of the data."""
        if not self.delivery.finished():
            self._unattended_since = None
            return False
        unfinished = [g.drafter for g in self.delivery.groups.values() if not g.ended]
        if not unfinished:
            return True
        now, timeout = time.monotonic(), self.transport.attach_timeout_s
        if self._unattended_since is None:
            self._unattended_since = now
            log.warning(
                "no consumer attached for unfinished drafter(s) %s; waiting up to %.0f s"
                " (transport.attach_timeout_s) for one to come back",
                unfinished,
                timeout,
            )
        if now - self._unattended_since <= timeout:
            return False
        log.error(
            "no consumer of drafter(s) %s came back within %.0f s: ending the job without their remaining batches",
            unfinished,
            timeout,
        )
        self.abandoned = unfinished
        return True

    def farewell(self) -> bool:
        """Tell every consumer the stream ended, then wait (bounded) for their releases and BYEs. False when,
        meanwhile, a consumer re-attached behind its group and has batches to be made again (not on a stop):
        the loop goes on, and its END follows them."""
        reason = self.stop_reason() or DATA_EXHAUSTED
        for m in list(self.delivery.by_peer.values()):
            if not m.told_end:
                self.channel.send(m.peer, End(reason, self.channel.last_seq))
                m.told_end = True
        grace = max(10.0, self.transport.heartbeat_timeout_s)
        deadline = time.monotonic() + grace
        while self.delivery.by_peer and time.monotonic() < deadline:
            self.sessions.handle_messages(timeout_s=POLL_S)
            if self.stop_reason() is None and not self.delivery.finished():
                return False  # a fenced session left batches it never trained, or one came back for them
        if self.delivery.by_peer:
            log.warning(
                "consumers %s did not say bye within %.0f s", [m.peer for m in self.delivery.by_peer.values()], grace
            )
        return True
