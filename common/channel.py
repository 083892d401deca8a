"""Control channel: producer ROUTER ↔ one DEALER per consumer, over ZeroMQ.

Each end's socket is owned by an I/O thread, so heartbeats keep flowing while the main thread runs a
long target forward or training step; the main thread talks to it through a queue (in) and a deque plus
an inproc wake-up socket (out). The I/O thread also notices stalls of its own process (SIGSTOP, swap):
a consumer asks `stalled_since(t)` before trusting a slot it copied, because a stall longer than the
heartbeat timeout means the producer may have fenced it and reused that slot.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from common.protocol import MAX_MESSAGE_BYTES, Heartbeat, Hello, Message, ProtocolError, decode, encode
from common.security import CurveClient, CurveServer, IpcFile, serve_curve, use_curve

log = logging.getLogger(__name__)

PRODUCER_PEER = b"producer"
TICK_S = 0.05  # I/O loop period when idle: bounds stall-detection and heartbeat jitter


@dataclass(frozen=True)
class Received:
    peer: bytes
    msg: Message
    time: float  # monotonic time the I/O thread received it


@dataclass(frozen=True)
class PeerLost:
    """Local event (never on the wire): a peer missed its heartbeats or became unreachable."""

    peer: bytes
    reason: str


Event = Received | PeerLost


@dataclass
class ChannelCounters:
    sent: int = 0
    received: int = 0
    decode_errors: int = 0
    send_errors: int = 0
    heartbeats_sent: int = 0
    peers_lost: int = 0


class _Channel:
    """The machinery both ends share: the I/O thread, the queues, heartbeats, loss and stall detection."""

    def __init__(self, sock: zmq.Socket, ctx: zmq.Context, heartbeat_interval_s: float, heartbeat_timeout_s: float):
        self._ctx = ctx
        self._sock = sock
        self._kind = sock.type
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.counters = ChannelCounters()
        self.last_seq = -1  # reported in heartbeats; set by the main thread
        self._inbox: queue.Queue[Event] = queue.Queue()
        self._outbox: collections.deque[tuple[bytes | None, bytes | None]] = collections.deque()
        wake_addr = f"inproc://wake-{id(self)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake_addr)
        for s in (self._wake_rx, self._wake_tx):
            s.setsockopt(zmq.LINGER, 0)
        self._last_seen: dict[bytes, float] = {}  # peers whose heartbeats we expect
        self._last_tick = time.monotonic()
        self._last_stall = -1.0  # monotonic time the last stall was noticed
        self.stalls = 0  # stalls noticed so far: a session that saw one may have been fenced
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{type(self).__name__}-io", daemon=True)

    # ------------------------------------------------------------------ main-thread side
    def start(self) -> None:
        self._thread.start()

    def _enqueue(self, peer: bytes | None, payload: bytes | None) -> None:
        self._outbox.append((peer, payload))
        with contextlib.suppress(zmq.Again):
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def recv(self, timeout_s: float) -> Event | None:
        """The next message or loss event, or None after `timeout_s`."""
        try:
            return self._inbox.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return None

    def stalled_since(self, t: float) -> bool:
        """True when this process stalled (or is stalled now) for long enough to have been fenced after `t`."""
        now = time.monotonic()
        limit = self.heartbeat_timeout_s / 2
        return self._last_stall >= t or (now - self._last_tick) > limit

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(zmq.Again):
            self._wake_tx.send(b"", zmq.NOBLOCK)
        self._thread.join(timeout=5.0)
        self._wake_tx.close(0)
        if self._thread.is_alive():
            log.warning("channel I/O thread did not stop within 5 s")
            return
        self._wake_rx.close(0)
        self._sock.close()
        self._ctx.term()

    # ------------------------------------------------------------------ I/O thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_beat = time.monotonic()
        while not self._stop.is_set():
            events = dict(poller.poll(TICK_S * 1000))
            now = time.monotonic()
            if now - self._last_tick > self.heartbeat_timeout_s / 2:
                self._last_stall = now
                self.stalls += 1
                log.warning("this process stalled for %.1f s (stopped or starved)", now - self._last_tick)
                # we could hear nobody while stopped: that silence was ours, so every peer gets a fresh timeout
                # (a woken consumer must not declare a live producer lost; the producer tells it if it was fenced)
                for peer in self._last_seen:
                    self._last_seen[peer] = now
            self._last_tick = now
            if self._wake_rx in events:
                with contextlib.suppress(zmq.Again):
                    while True:
                        self._wake_rx.recv(zmq.NOBLOCK)
            self._flush_outbox()
            if self._sock in events:
                self._drain_socket(now)
            if now >= next_beat:
                self._send_heartbeats()
                next_beat = now + self.heartbeat_interval_s
            self._expire_peers(now)
        self._flush_outbox()  # a BYE or END queued just before close() still goes out (LINGER bounds it)

    def _flush_outbox(self) -> None:
        while self._outbox:
            peer, payload = self._outbox.popleft()
            if payload is None:  # a "forget this peer" command
                self._last_seen.pop(peer, None)
                continue
            self._send_frames(peer, payload)

    def _send_frames(self, peer: bytes | None, payload: bytes) -> None:
        try:
            if peer is None or self._kind == zmq.DEALER:
                self._sock.send(payload, zmq.NOBLOCK)
            else:
                self._sock.send_multipart([peer, payload], zmq.NOBLOCK)
            self.counters.sent += 1
        except zmq.ZMQError as err:
            self.counters.send_errors += 1
            target = peer or PRODUCER_PEER
            if target in self._last_seen:
                # what the peer sent before it went (a BYE) is still queued: it goes up before the loss,
                # so a consumer that said bye and closed is not taken for a crashed one
                self._drain_socket(time.monotonic())
                self._lose(target, f"send failed: {err.strerror}")

    def _drain_socket(self, now: float) -> None:
        for _ in range(1000):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer, payload = (frames[0], frames[-1]) if self._kind == zmq.ROUTER else (PRODUCER_PEER, frames[-1])
            if len(frames) != (2 if self._kind == zmq.ROUTER else 1):
                self.counters.decode_errors += 1
                log.warning("rejected a message of %d frames from %r", len(frames), peer)
                continue
            try:
                msg = decode(payload)
            except ProtocolError as err:
                self.counters.decode_errors += 1
                log.warning("rejected a message from %r: %s", peer, err)
                continue
            self.counters.received += 1
            self._on_message(peer, msg, now)
            # a heartbeat from a peer we do not follow (fenced while stopped) goes up: it is told to re-attach
            if not isinstance(msg, Heartbeat) or peer not in self._last_seen:
                self._inbox.put(Received(peer, msg, now))

    def _on_message(self, peer: bytes, msg: Message, now: float) -> None:
        if peer in self._last_seen:
            self._last_seen[peer] = now

    def _send_heartbeats(self) -> None:
        beat = encode(Heartbeat(time.time(), self.last_seq))
        for peer in list(self._last_seen):
            self._send_frames(peer, beat)
            self.counters.heartbeats_sent += 1

    def _expire_peers(self, now: float) -> None:
        for peer, seen in list(self._last_seen.items()):
            if now - seen > self.heartbeat_timeout_s:
                self._lose(peer, f"no message for {now - seen:.1f} s (heartbeat timeout {self.heartbeat_timeout_s} s)")

    def _lose(self, peer: bytes, reason: str) -> None:
        self._last_seen.pop(peer, None)
        self.counters.peers_lost += 1
        self._inbox.put(PeerLost(peer, reason))


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 200)  # ms: enough to deliver a last BYE/END, never a hang
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 1024)
    return sock


class ProducerChannel(_Channel):
    """The producer's ROUTER. A consumer becomes a heartbeat peer when it says HELLO; it is lost (fenced)
    when it misses heartbeats; `forget(peer)` drops one that said BYE."""

    def __init__(
        self, endpoint: str, heartbeat_interval_s: float, heartbeat_timeout_s: float, curve: CurveServer | None = None
    ):
        """`curve`: authenticate every connection with CURVE, admitting only the job's client keys (tcp)."""
        ctx = zmq.Context()
        sock = _socket(ctx, zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._auth = serve_curve(sock, ctx, curve) if curve is not None else None
        self._lock_fd = _lock_ipc_endpoint(endpoint)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as err:
            sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            ctx.term()
            raise RuntimeError(f"cannot bind the control endpoint {endpoint}: {err.strerror}") from None
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc_file = IpcFile(self.endpoint)
        super().__init__(sock, ctx, heartbeat_interval_s, heartbeat_timeout_s)
        self.start()

    def send(self, peer: bytes, msg: Message) -> None:
        self._enqueue(peer, encode(msg))

    def forget(self, peer: bytes) -> None:
        self._enqueue(peer, None)

    def _on_message(self, peer: bytes, msg: Message, now: float) -> None:
        if isinstance(msg, Hello):
            self._last_seen[peer] = now
        super()._on_message(peer, msg, now)

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        super().close()
        self._ipc_file.remove()
        if self._lock_fd is not None:
            os.close(self._lock_fd)


class ConsumerChannel(_Channel):
    """A consumer's DEALER. The producer counts as lost once it has spoken and then falls silent for the
    heartbeat timeout; before it first speaks, the caller's own wait (attach timeout) applies."""

    def __init__(
        self,
        endpoint: str,
        identity: str,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        curve: CurveClient | None = None,
    ):
        ctx = zmq.Context()
        sock = _socket(ctx, zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        if curve is not None:
            use_curve(sock, curve)
        sock.connect(endpoint)
        super().__init__(sock, ctx, heartbeat_interval_s, heartbeat_timeout_s)
        self.start()

    def send(self, msg: Message) -> None:
        self._enqueue(None, encode(msg))

    def _on_message(self, peer: bytes, msg: Message, now: float) -> None:
        self._last_seen[PRODUCER_PEER] = now


def _lock_ipc_endpoint(endpoint: str) -> int | None:
    """One producer per ipc endpoint: a second bind would silently steal the path (transport.md)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = Path(endpoint.removeprefix("ipc://"))
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise RuntimeError(
            f"another producer (pid {holder or '?'}) holds {path}; is the job already running?"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    path.unlink(missing_ok=True)  # a stale socket file left by a crashed producer
    return fd
