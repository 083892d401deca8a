"""The soak's fault injectors that are not signals: hostile messages and a full checkpoint disk.

Hostile messages go to the two endpoints any local process of the job's user can reach: the producer's
control ROUTER and telemetry's stats ingest SUB. Each batch mixes garbage, truncated and wrongly typed
msgpack, wrong frame counts, messages over the size limits (ZeroMQ drops the connection) and well-formed
messages from sessions the producer does not know. None may crash a receiver or stop training.

A stats flood (`stats_flood`) sends valid messages as fast as one process can, most under new names.

The full disk is real: the drafter's checkpoint folder is a small tmpfs (root only: `mount -t tmpfs`), and
a filler file leaves less room than one checkpoint, so the next save fails with ENOSPC from the kernel.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import time
from pathlib import Path

import msgpack
import zmq

from common.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Attached,
    Bye,
    Heartbeat,
    Hello,
    Release,
    encode,
)
from common.stats import MAX_PAYLOAD_BYTES, TOPIC_PREFIX

FILLER = ".soak-filler"


def control_garbage() -> list[list[bytes]]:
    """Frames a DEALER sends to the producer (the ROUTER prepends the identity)."""
    v = PROTOCOL_VERSION
    return [
        [b""],
        [b"\xff\x00garbage"],
        [secrets.token_bytes(200)],
        [msgpack.packb([v])],  # too short
        [msgpack.packb([v + 7, 1, "d0"])],  # another protocol version
        [msgpack.packb([v, 99, 1, 2])],  # unknown type
        [msgpack.packb([v, Hello.TYPE, "d0", 0])],  # too few fields
        [msgpack.packb([v, Release.TYPE, "x", [[1, 2]]])],  # wrong field type
        [msgpack.packb([v, Release.TYPE, 1, [[1, 2, 3]] * 10])],  # wrong tuple arity
        [msgpack.packb([v, Hello.TYPE, "d" * 100_000, 0, 1, "", 0, False])],  # string over the limit
        [msgpack.packb({"v": v})],  # a map, not an array
        [msgpack.packb([v, Release.TYPE, 1, [[i, 0] for i in range(70_000)]])],  # list over the limit
        [b"\x92\x01"],  # truncated msgpack
        [encode(Heartbeat(0.0, 0)), b"extra frame"],  # wrong frame count
        # well formed, from a session the producer does not know: ignored, answered with a non-fatal FAIL
        [encode(Release(123456, [(0, 0), (1, 1)]))],
        [encode(Attached(987654))],
        [encode(Heartbeat(time.time(), 5))],
        [encode(Bye("stray", 3))],
        [encode(Hello("no_such_drafter", 0, 1, "", 0))],  # refused with a fatal FAIL to this peer only
        # HELLOs that do not fit the job: refused and counted, never a group member
        [encode(Hello("d0", 2**64 - 1, 1, "", 0))],  # replica index outside the drafter's replicas
        [encode(Hello("d0", 0, 1, "", 0, node=5))],  # another node's consumer
        [encode(Hello("d0", 0, 1, "", 0, launch="not-this-launch"))],  # another launch of the job
    ]


def hostile_control(endpoint: str, timeout_s: float = 2.0) -> int:
    """Send every garbage message from one stray peer and one oversized message from another; returns
    how many were sent. Replies (FAIL) are read and ignored."""
    ctx = zmq.Context()
    sent = 0
    try:
        stray = ctx.socket(zmq.DEALER)
        stray.setsockopt(zmq.LINGER, int(timeout_s * 1000))
        stray.setsockopt(zmq.IDENTITY, b"stray-" + secrets.token_hex(4).encode())
        stray.connect(endpoint)
        for frames in control_garbage():
            stray.send_multipart(frames)
            sent += 1
        big = ctx.socket(zmq.DEALER)  # over MAXMSGSIZE: the producer's socket drops this connection
        big.setsockopt(zmq.LINGER, int(timeout_s * 1000))
        big.connect(endpoint)
        big.send(b"\x00" * (MAX_MESSAGE_BYTES + 4096))
        sent += 1
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # drain the producer's FAIL answers
            if stray.poll(50):
                stray.recv_multipart()
        for s in (stray, big):
            s.close()
    finally:
        ctx.term()
    return sent


def stats_garbage() -> list[list[bytes]]:
    big = TOPIC_PREFIX + b"x.y"
    return [
        [b"stats.consumer.x", b"not msgpack \xff"],
        [b"stats.consumer.x", msgpack.packb([1, 2, 3])],
        [b"stats.consumer.x", msgpack.packb({"v": 1, "source": "x"})],
        [b"stats.consumer.x", msgpack.packb({"v": 99})],
        [b"stats.only-a-topic"],
        [b"stats.a.b", b"", b"third frame"],
        [big, b"\x00" * (MAX_PAYLOAD_BYTES + 10)],  # over the payload limit, under MAXMSGSIZE
        [big, b"\x00" * (4 * MAX_PAYLOAD_BYTES + 10)],  # over MAXMSGSIZE: telemetry drops this connection
    ]


def hostile_telemetry(endpoint: str, timeout_s: float = 2.0) -> int:
    """Publish garbage to telemetry's ingest (it binds a SUB; we connect a PUB as every publisher does)."""
    ctx = zmq.Context()
    try:
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, int(timeout_s * 1000))
        pub.connect(endpoint)
        if not pub.poll(int(timeout_s * 1000)):  # the subscription arrives once connected (slow joiner)
            pub.close()
            return 0
        pub.recv()
        messages = stats_garbage()
        for frames in messages:
            pub.send_multipart(frames)
        time.sleep(0.2)
        pub.close()
    finally:
        ctx.term()
    return len(messages)


def stats_flood(endpoint: str, seconds: float) -> int:
    """As fast as one process can for `seconds`: valid stats messages, half under a new source name each, half
    under one name (issue 24 item 7). Returns how many were offered (a full XPUB pipe drops them silently)."""
    from common.stats import StatsPayload, encode_stats

    ctx = zmq.Context()
    sent = 0
    try:
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 1000)
        pub.connect(endpoint)
        if not pub.poll(5000):
            pub.close()
            return 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(200):
                p = StatsPayload(
                    role="consumer",
                    name=f"flood{sent}" if sent % 2 else "flood",
                    pid=1,
                    host="h",
                    seq=sent,
                    wall_time=time.time(),
                    mono_time=time.monotonic(),
                    uptime_s=1.0,
                    step=0,
                    final=False,
                    timers={},
                    gpu_timers={},
                    counters={"tokens": 1.0},
                    gauges={},
                    cuda_memory={},
                    cuda_device=None,
                    gpu_uuid=None,
                    process={"cpu_s": 0.0, "rss_bytes": 1},
                )
                pub.send_multipart(encode_stats(p), zmq.NOBLOCK)
                sent += 1
        pub.close()
    finally:
        ctx.term()
    return sent


# ---------------------------------------------------------------------------------------------- full disk
def mount_tmpfs(path: Path, size_mib: int) -> None:
    """A tmpfs of `size_mib` at `path` (root only); raises RuntimeError with mount's message otherwise."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"cannot mount a tmpfs at {path}: {done.stderr.strip() or done.returncode}")


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path, leave_bytes: int) -> int:
    """Fill the filesystem at `path` until `leave_bytes` are free; returns the filler's size."""
    st = os.statvfs(path)
    size = max(0, st.f_bavail * st.f_frsize - leave_bytes)
    fd = os.open(path / FILLER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    return size


def unfill(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (path / FILLER).unlink()
