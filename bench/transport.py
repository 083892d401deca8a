"""Hand-off of one batch between two processes: the slot ring against two copying baselines.

Hand-off time, measured on the producer's clock, is from "the batch is ready to send" to "the consumer
holds it and has said so":
  ring     the producer has written the slot; it sends (seq, slot, layout) as msgpack over zmq PAIR; the
           consumer takes views into the slot and sends a RELEASE back. The slot write is timed apart.
  mpqueue  torch.multiprocessing.Queue.put of a fresh batch (torch moves it into new shared memory and
           pickles the handle: the baseline, acceptable in a benchmark only); the consumer acks over zmq.
  zmqcopy  the batch's bytes go through the socket (send copy=False, so only the socket copies them);
           the consumer wraps the frames as tensors and acks.
A bare zmq round trip of a 64-byte msgpack message is the floor.

The consumer blocks in recv between batches, and on a shared VM waking a process costs more the longer it
slept (1 MiB hand-offs measured 65 us back to back, 195 us after 3 ms idle, 410 us after 15 ms). Back to
back, the ring's consumer sleeps as long as the slot write takes, which grows with size and would be
mistaken for a size cost. So every timed send, in every variant and for the round trip, follows the same
consumer idle time (--gap-ms); the back-to-back ring figures are reported too.
Run: .venv/bin/python -m bench.transport [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import msgpack
import torch
import zmq

from common.ring import SlotRing, layout_from_wire, layout_to_wire
from common.slot_table import SlotTable

SIZES = {"1MiB": 1 << 20, "16MiB": 16 << 20, "64MiB": 64 << 20, "256MiB": 256 << 20}
RING_REPS = {"1MiB": 200, "16MiB": 150, "64MiB": 100, "256MiB": 40}
COPY_REPS = {"1MiB": 30, "16MiB": 15, "64MiB": 10, "256MiB": 5}
PING_REPS = {"paced": 200, "backtoback": 2000}
WIDTH = 2560  # bf16 features per token: hidden [T, WIDTH] dominates the batch as in the real service
TIMEOUT_MS = 120_000
ROOT = Path(__file__).resolve().parent.parent


def make_batch(nbytes: int, seq: int) -> dict[str, torch.Tensor]:
    """A packed batch of about `nbytes`: hidden [T, WIDTH] bf16, input_ids [T], loss_mask [T], cu_seqlens."""
    tokens = max(1, nbytes // (WIDTH * 2 + 9))
    batch = {
        "hidden": torch.full((tokens, WIDTH), float(seq % 7), dtype=torch.bfloat16),
        "input_ids": torch.arange(tokens, dtype=torch.int64),
        "loss_mask": torch.ones(tokens, dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, tokens], dtype=torch.int32),
    }
    batch["input_ids"][0] = seq  # the consumer checks this tag: it holds the right batch
    return batch


def _pair(ctx: zmq.Context, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sock.setsockopt(zmq.SNDTIMEO, TIMEOUT_MS)
    (sock.bind if bind else sock.connect)(endpoint)
    return sock


def _recv(sock: zmq.Socket):
    return msgpack.unpackb(sock.recv(), raw=False)


# ------------------------------------------------------------------------------------------ consumers


def _ring_consumer(endpoint: str) -> None:
    ctx = zmq.Context()
    sock = _pair(ctx, endpoint, bind=False)
    ring = SlotRing.attach(_recv(sock))
    sock.send(msgpack.packb("attached"))
    while True:
        msg = _recv(sock)
        if msg == "end":
            break
        if msg[0] == "ping":
            sock.send(msgpack.packb(msg))
            continue
        t0 = time.perf_counter()
        seq, slot, layout = msg
        views = ring.view(slot, layout_from_wire(layout))
        ok = int(views["input_ids"][0]) == seq
        del views  # released: nothing of the slot is kept past this point
        sock.send(msgpack.packb([seq, ok, slot, time.perf_counter() - t0]))
    ring.close()
    sock.close()
    ctx.term()


def _zmqcopy_consumer(endpoint: str) -> None:
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    ctx = zmq.Context()
    sock = _pair(ctx, endpoint, bind=False)
    sock.send(msgpack.packb("ready"))
    while True:
        header, *frames = sock.recv_multipart(copy=False)
        msg = msgpack.unpackb(header.bytes)
        if msg == "end":
            break
        seq, specs = msg
        batch = {
            name: torch.frombuffer(frame.buffer, dtype=getattr(torch, dtype)).view(shape)
            for (name, dtype, shape), frame in zip(specs, frames, strict=True)
        }
        ok = int(batch["input_ids"][0]) == seq
        del batch
        sock.send(msgpack.packb([seq, ok]))
    sock.close()
    ctx.term()


def _mpqueue_consumer(queue, endpoint: str) -> None:
    torch.set_num_threads(1)
    ctx = zmq.Context()
    sock = _pair(ctx, endpoint, bind=False)
    sock.send(msgpack.packb("ready"))
    while True:
        item = queue.get(timeout=TIMEOUT_MS / 1000)
        if item is None:
            break
        seq, batch = item
        ok = int(batch["input_ids"][0]) == seq
        del batch, item
        sock.send(msgpack.packb([seq, ok]))
    sock.close()
    ctx.term()


# ------------------------------------------------------------------------------------------ producers


def _check_ack(ack: list, seq: int, mode: str) -> None:
    if ack[0] != seq or ack[1] is not True:
        raise RuntimeError(f"{mode}: consumer acked {ack} for seq {seq}: it did not hold the right batch")


def _pace(since: float, gap: float) -> None:
    """Let the consumer idle `gap` seconds since its last ack: every variant wakes it from the same state."""
    time.sleep(max(0.0, since + gap - time.perf_counter()))


def run_ring(sock: zmq.Socket, sizes: dict, reps: dict, warmup: int, gap: float) -> dict:
    """Per size: hand-off, slot write and consumer work samples (seconds), and ping round trips."""
    ring = SlotRing.create("cpu", 2, max(sizes.values()) + (64 << 10), name=f"bench-{os.getpid()}")
    table = SlotTable(ring.num_slots)
    out = {"handoff": {}, "write": {}, "consumer": {}}
    try:
        sock.send(msgpack.packb(ring.handle()))
        assert _recv(sock) == "attached"
        seq, t_ack = 0, time.perf_counter()
        for label, nbytes in sizes.items():
            batch = make_batch(nbytes, 0)
            for key in out:
                out[key][label] = []
            for i in range(warmup + reps[label]):
                seq += 1
                batch["input_ids"][0] = seq
                slot = table.acquire()
                t0 = time.perf_counter()
                layout = ring.write(slot, batch)
                ring.write_event(slot)
                while not ring.is_written(slot):
                    pass
                table.publish(slot, seq, ["c0"])
                t_written = time.perf_counter()
                _pace(t_ack, gap)
                t1 = time.perf_counter()
                sock.send(msgpack.packb([seq, slot, layout_to_wire(layout)]))
                ack = _recv(sock)
                t_ack = time.perf_counter()
                _check_ack(ack, seq, "ring")
                if not table.release("c0", ack[0], ack[2]):
                    raise RuntimeError(f"ring: release {ack} was not expected")
                if i >= warmup:
                    out["write"][label].append(t_written - t0)
                    out["handoff"][label].append(t_ack - t1)
                    out["consumer"][label].append(ack[3])
        out["ping"] = []
        for _ in range(PING_REPS["paced" if gap else "backtoback"]):
            _pace(t_ack, gap)
            t0 = time.perf_counter()
            sock.send(msgpack.packb(["ping", "x" * 50]))
            _recv(sock)
            t_ack = time.perf_counter()
            out["ping"].append(t_ack - t0)
        sock.send(msgpack.packb("end"))
    finally:
        ring.close()
    return out


def run_zmqcopy(sock: zmq.Socket, sizes: dict, reps: dict, warmup: int, gap: float) -> dict:
    assert _recv(sock) == "ready"
    out, seq, t_ack = {}, 0, time.perf_counter()
    for label, nbytes in sizes.items():
        batch = make_batch(nbytes, 0)
        specs = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in batch.items()]
        frames = [t.view(torch.uint8).numpy() for t in batch.values()]
        out[label] = []
        for i in range(warmup + reps[label]):
            seq += 1
            batch["input_ids"][0] = seq
            _pace(t_ack, gap)
            t0 = time.perf_counter()
            sock.send_multipart([msgpack.packb([seq, specs]), *frames], copy=False)
            ack = _recv(sock)  # also means the frames were sent: the buffers are free to reuse
            t_ack = time.perf_counter()
            _check_ack(ack, seq, "zmqcopy")
            if i >= warmup:
                out[label].append(t_ack - t0)
    sock.send_multipart([msgpack.packb("end")])
    return out


def run_mpqueue(sock: zmq.Socket, sizes: dict, reps: dict, warmup: int, gap: float, *, queue) -> dict:
    assert _recv(sock) == "ready"
    out, seq, t_ack = {}, 0, time.perf_counter()
    for label, nbytes in sizes.items():
        out[label] = []
        for i in range(warmup + reps[label]):
            seq += 1
            batch = make_batch(nbytes, seq)  # a new tensor each time, as a Queue-based design would send
            _pace(t_ack, gap)
            t0 = time.perf_counter()
            queue.put((seq, batch))
            ack = _recv(sock)
            t_ack = time.perf_counter()
            _check_ack(ack, seq, "mpqueue")
            del batch
            if i >= warmup:
                out[label].append(t_ack - t0)
    queue.put(None)
    return out


def _serve(ctx: zmq.Context, workdir: str, mode: str, run, *args) -> dict:
    """One consumer process per variant, connected over a fresh ipc:// PAIR in a 0700 folder."""
    endpoint = f"ipc://{workdir}/{mode}.sock"
    sock = _pair(ctx, endpoint, bind=True)
    kwargs = {}
    if mode == "mpqueue":
        spawn = mp.get_context("spawn")
        kwargs["queue"] = spawn.Queue()
        proc = spawn.Process(target=_mpqueue_consumer, args=(kwargs["queue"], endpoint))
        proc.start()
    else:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "bench.transport", "--consumer", mode, "--endpoint", endpoint]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:
        return run(sock, *args, **kwargs)
    finally:
        sock.close()
        if isinstance(proc, subprocess.Popen):
            code = proc.wait(60)
        else:
            proc.join(60)
            code = proc.exitcode
        if code != 0:
            raise RuntimeError(f"{mode} consumer exited with status {code}")


def _ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every repetition count")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"subset of {','.join(SIZES)}")
    p.add_argument("--gap-ms", type=float, default=30.0, help="consumer idle time before each timed send")
    p.add_argument("--consumer", choices=["ring", "zmqcopy"], help=argparse.SUPPRESS)  # internal
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # on 2 shared cores a 2-thread copy waits milliseconds for a descheduled thread
    if args.consumer:
        {"ring": _ring_consumer, "zmqcopy": _zmqcopy_consumer}[args.consumer](args.endpoint)
        return {}

    sizes = {label: SIZES[label] for label in args.sizes.split(",")}
    ring_reps = {k: max(5, int(v * args.scale)) for k, v in RING_REPS.items()}
    copy_reps = {k: max(3, int(v * args.scale)) for k, v in COPY_REPS.items()}
    gap = args.gap_ms / 1e3
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="bench-transport-") as workdir:
        os.chmod(workdir, 0o700)
        ring = _serve(ctx, workdir, "ring", run_ring, sizes, ring_reps, 5, gap)
        hot = _serve(ctx, workdir, "ring", run_ring, sizes, ring_reps, 5, 0.0)
        zcopy = _serve(ctx, workdir, "zmqcopy", run_zmqcopy, sizes, copy_reps, 2, gap)
        mpq = _serve(ctx, workdir, "mpqueue", run_mpqueue, sizes, copy_reps, 2, gap)
    ctx.term()

    ring_ms = {k: _ms(v) for k, v in ring["handoff"].items()}
    mpq_ms = {k: _ms(v) for k, v in mpq.items()}
    zcopy_ms = {k: _ms(v) for k, v in zcopy.items()}
    ping_ms = _ms(ring["ping"])
    result = {
        "handoff_ms_ring": ring_ms,
        "handoff_ms_mpqueue": mpq_ms,
        "handoff_ms_zmqcopy": zcopy_ms,
        "zmq_roundtrip_ms": ping_ms,
        "gap_ms": args.gap_ms,
        "write_ms_ring": {k: _ms(v) for k, v in ring["write"].items()},
        "consumer_ms_ring": {k: _ms(v) for k, v in ring["consumer"].items()},
        "handoff_ms_ring_backtoback": {k: _ms(v) for k, v in hot["handoff"].items()},
        "zmq_roundtrip_ms_backtoback": _ms(hot["ping"]),
        "reps_ring": ring_reps,
        "reps_baselines": copy_reps,
    }
    if "64MiB" in sizes:
        result["ratio_mpqueue_over_ring_64MiB"] = round(mpq_ms["64MiB"] / ring_ms["64MiB"], 2)
        result["ratio_zmqcopy_over_ring_64MiB"] = round(zcopy_ms["64MiB"] / ring_ms["64MiB"], 2)
        write_plus = ring_ms["64MiB"] + result["write_ms_ring"]["64MiB"]
        result["ratio_mpqueue_over_ring_write_plus_handoff_64MiB"] = round(mpq_ms["64MiB"] / write_plus, 2)
    if {"1MiB", "256MiB"} <= sizes.keys():
        result["handoff_growth_1_to_256MiB"] = round(ring_ms["256MiB"] / ring_ms["1MiB"], 3)
        b2b = result["handoff_ms_ring_backtoback"]
        result["handoff_growth_1_to_256MiB_backtoback"] = round(b2b["256MiB"] / b2b["1MiB"], 3)
    result["ring_over_zmq_roundtrip"] = round(max(ring_ms.values()) / ping_ms, 2)  # the worst size

    print(f"hand-off medians in ms; every timed send follows {args.gap_ms:g} ms of consumer idleness")
    head = ["size", "ring", "mpqueue", "zmqcopy", "ring b2b", "ring write", "ring cons."]
    print(" ".join(f"{h:>11}" for h in head))
    for label in sizes:
        row = [ring_ms, mpq_ms, zcopy_ms, result["handoff_ms_ring_backtoback"], result["write_ms_ring"]]
        row.append(result["consumer_ms_ring"])
        print(f"{label:>11} " + " ".join(f"{col[label]:>11.3f}" for col in row))
    print(
        f"bare zmq round trip (64 B msgpack): {ping_ms:.3f} ms, back to back {result['zmq_roundtrip_ms_backtoback']:.3f} ms"
    )
    for key in [k for k in result if k.startswith(("ratio", "handoff_growth", "ring_over"))]:
        print(f"{key}: {result[key]}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
