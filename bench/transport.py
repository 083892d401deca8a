"""The whole path of one batch between two processes: the slot ring against competent baselines (CPU).

Timed span, on the producer's clock, per batch: from "the batch is ready in the producer's memory" to
"the producer knows the consumer holds its own copy and the producer's memory is free for the next one":
  ring          the producer writes the batch into a free slot by the producer's own path (SlotRing.begin_write
                / end_write with the seq tag, one memcpy) and sends (seq, slot, layout) as msgpack over zmq
                PAIR; the consumer takes views into the slot and copies them out with consumer/copy_out.py
                (its buffers allocated once and reused, the seq tag read after the data: one memcpy, what
                consumer/stream.py does), and sends RELEASE at once.
  mpqueue_pool  plain torch.multiprocessing done well: a pool of shared-memory tensors made once, handed to
                the consumer once at start and reused round-robin; per batch the producer copies the batch
                into the next pool entry (one memcpy) and puts (seq, entry, tokens) on a torch mp.Queue; the
                consumer copies the entry into its own buffers (one memcpy) and returns the entry on a
                second queue. The same two copies as the ring: only the hand-off differs.
  zmqcopy       the batch's bytes go through a zmq ipc socket (send copy=False, so the socket copies them
                into the kernel and out into the consumer's message buffers); the consumer wraps the
                received frames as its tensors (no copy-out needed: they are its own) and acks.
  memcpy        one in-process copy of the same bytes into a preallocated buffer, no other process, from
                and to memory that is not in cache (buffers rotate through 128 MiB): the cost of one copy
                on this machine, timed once per batch of every variant, under the same load.
  fp8           transport.features = "fp8" (common/fp8.py): the bytes a slot's layout takes for the same batch
                with bf16 and with FP8 features (e4m3 and a float32 scale per row), their ratio, and the
                quantise (producer) and dequantise (consumer, to bf16) times of that batch, in this process.
The ring and mpqueue_pool paths each cost two copies plus a round trip of small messages, so their floor
is `2 × memcpy + zmq_roundtrip` (reported per size as `e2e_ms_two_copy_floor`); `e2e_growth_1_to_256MiB`
of a copy-bound path follows `memcpy_growth_1_to_256MiB`.

Every process runs one torch thread (a copy on 2 shared cores with 2 threads waits on a descheduled thread).
The consumer blocks in recv between batches, and on a shared VM waking a process costs more the longer it
slept; so every timed batch, in every variant, follows the same consumer idle time (--gap-ms).
Run: .venv/bin/python -m bench.transport [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
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
import torch.multiprocessing as tmp
import zmq

from common.fp8 import dequantize_rows, quantize_rows
from common.packed_batch import FP8, SCALE, SEQ_TAG, PackedBatch, slot_items
from common.ring import SlotRing, layout_from_wire, layout_to_wire, plan_layout
from consumer.copy_out import CopyOut
from producer.slot_table import SlotTable

SIZES = {"1MiB": 1 << 20, "16MiB": 16 << 20, "64MiB": 64 << 20, "256MiB": 256 << 20}
REPS = {"1MiB": 100, "16MiB": 60, "64MiB": 40, "256MiB": 15}
PING_REPS = 200
COLD_SET = 128 << 20  # bytes the memcpy floor rotates through: beyond any last-level cache here
POOL = 2  # ring slots and pool entries: the producer can fill one while the consumer reads the other
WIDTH = 2560  # bf16 features per token: hidden [T, WIDTH] dominates the batch as in the real service
TIMEOUT_S = 120
ROOT = Path(__file__).resolve().parent.parent
TARGETS = {
    "e2e_ratio_mpqueue_pool_over_ring_64MiB": (">=", 0.95),
    "e2e_ratio_zmqcopy_over_ring_64MiB": (">=", 2.0),
}


def tokens_for(nbytes: int) -> int:
    return max(1, nbytes // (WIDTH * 2 + 9))


def make_batch(nbytes: int, seq: int) -> dict[str, torch.Tensor]:
    """A packed batch of about `nbytes`: hidden [T, WIDTH] bf16, input_ids [T], loss_mask [T], cu_seqlens."""
    tokens = tokens_for(nbytes)
    batch = PackedBatch(
        seq,
        0,
        [seq],
        torch.arange(tokens, dtype=torch.int64),
        torch.ones(tokens, dtype=torch.uint8),
        torch.tensor([0, tokens], dtype=torch.int32),
        hidden=torch.full((tokens, WIDTH), float(seq % 7), dtype=torch.bfloat16),
    ).tensors()
    batch["input_ids"][0] = seq  # the consumer checks this tag on its own copy: it holds the right batch
    return batch


def own_buffers(nbytes: int) -> dict[str, torch.Tensor]:
    """The consumer's copy-out buffers, allocated once at the largest size and touched (as a real one)."""
    return {name: torch.zeros_like(t) for name, t in make_batch(nbytes, 0).items()}


def copy_out(buffers: dict[str, torch.Tensor], views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: buffers[name][: v.shape[0]].copy_(v) for name, v in views.items()}


def holds(batch: dict[str, torch.Tensor], seq: int) -> bool:
    return int(batch["input_ids"][0]) == seq and float(batch["hidden"][-1, -1]) == float(seq % 7)


def _pair(ctx: zmq.Context, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_S * 1000)
    sock.setsockopt(zmq.SNDTIMEO, TIMEOUT_S * 1000)
    (sock.bind if bind else sock.connect)(endpoint)
    return sock


def _recv(sock: zmq.Socket):
    return msgpack.unpackb(sock.recv(), raw=False)


def _pace(since: float, gap: float) -> None:
    """Let the consumer idle `gap` seconds since its last ack: every variant wakes it from the same state."""
    time.sleep(max(0.0, since + gap - time.perf_counter()))


def _check(ack: list, seq: int, mode: str) -> None:
    if ack[0] != seq or ack[1] is not True:
        raise RuntimeError(f"{mode}: consumer acked {ack} for seq {seq}: its copy is not the batch sent")


# ------------------------------------------------------------------------------------------ consumers


def _ring_consumer(endpoint: str, max_bytes: int) -> None:
    ctx = zmq.Context()
    sock = _pair(ctx, endpoint, bind=False)
    ring = SlotRing.attach(_recv(sock))
    copier = CopyOut(torch.device("cpu"), ring.device, min_rows=tokens_for(max_bytes))
    copier.copy(make_batch(max_bytes, 0), None)  # its buffers allocated and touched once, as a real consumer's
    sock.send(msgpack.packb("attached"))
    while True:
        msg = _recv(sock)
        if msg == "end":
            break
        if msg[0] == "ping":
            sock.send(msgpack.packb(msg))
            continue
        seq, slot, layout = msg
        t0 = time.perf_counter()
        views = ring.view(slot, layout_from_wire(layout))
        tag = views.pop(SEQ_TAG)
        mine, seq_tag = copier.copy(views, tag)
        copy_s = time.perf_counter() - t0
        sock.send(msgpack.packb([seq, holds(mine, seq) and seq_tag == seq, slot, copy_s]))  # RELEASE: the slot is free
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
        mine = {  # the received frames are this process's own memory: they are the batch
            name: torch.frombuffer(frame.buffer, dtype=getattr(torch, dtype)).view(shape)
            for (name, dtype, shape), frame in zip(specs, frames, strict=True)
        }
        sock.send(msgpack.packb([seq, holds(mine, seq)]))
    sock.close()
    ctx.term()


def _mpqueue_consumer(to_consumer, to_producer, max_bytes: int) -> None:
    torch.set_num_threads(1)
    pool = to_consumer.get(timeout=TIMEOUT_S)  # the shared tensors, once; kept for the whole run
    buffers = own_buffers(max_bytes)
    to_producer.put("ready")
    while True:
        item = to_consumer.get(timeout=TIMEOUT_S)
        if item is None:
            break
        seq, entry, tokens = item
        views = {name: t[:tokens] if name != "cu_seqlens" else t for name, t in pool[entry].items()}
        mine = copy_out(buffers, views)
        to_producer.put((seq, holds(mine, seq), entry))  # the entry is free again


# ------------------------------------------------------------------------------------------ producers


def run_ring(sock: zmq.Socket, sizes: dict, reps: dict, warmup: int, gap: float, floor: MemcpyFloor) -> dict:
    """Per size: end-to-end, slot write and consumer copy-out samples (seconds); ping round trips."""
    ring = SlotRing.create("cpu", POOL, max(sizes.values()) + (64 << 10), name=f"bench-{os.getpid()}")
    table = SlotTable(ring.num_slots)
    out: dict = {"e2e": {}, "write": {}, "copy_out": {}}
    try:
        sock.send(msgpack.packb(ring.handle()))
        assert _recv(sock) == "attached"
        seq, t_ack = 0, time.perf_counter()
        for label, nbytes in sizes.items():
            batch = make_batch(nbytes, 0)
            for samples in out.values():
                samples[label] = []
            for i in range(warmup + reps[label]):
                seq += 1
                batch["input_ids"][0] = seq
                batch["hidden"][-1, -1] = seq % 7
                floor.sample(label, nbytes)
                _pace(t_ack, gap)
                t0 = time.perf_counter()
                slot = table.acquire()
                layout = plan_layout(slot_items(batch["input_ids"].shape[0], 1, WIDTH, "bfloat16"))
                views = ring.begin_write(slot, layout)  # the producer's path (producer/service.py _write_slot)
                ring.end_write(slot, views, batch, seq)
                table.publish(slot, seq, ["c0"])
                t_written = time.perf_counter()
                sock.send(msgpack.packb([seq, slot, layout_to_wire(layout)]))
                ack = _recv(sock)
                t_ack = time.perf_counter()
                _check(ack, seq, "ring")
                if not table.release("c0", ack[0], ack[2]):
                    raise RuntimeError(f"ring: release {ack} was not expected")
                if i >= warmup:
                    out["e2e"][label].append(t_ack - t0)
                    out["write"][label].append(t_written - t0)
                    out["copy_out"][label].append(ack[3])
        out["ping"] = []
        for _ in range(PING_REPS):
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


def run_zmqcopy(sock: zmq.Socket, sizes: dict, reps: dict, warmup: int, gap: float, floor: MemcpyFloor) -> dict:
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
            batch["hidden"][-1, -1] = seq % 7
            floor.sample(label, nbytes)
            _pace(t_ack, gap)
            t0 = time.perf_counter()
            sock.send_multipart([msgpack.packb([seq, specs]), *frames], copy=False)
            ack = _recv(sock)  # also means the frames were sent: the buffers are free to reuse
            t_ack = time.perf_counter()
            _check(ack, seq, "zmqcopy")
            if i >= warmup:
                out[label].append(t_ack - t0)
    sock.send_multipart([msgpack.packb("end")])
    return out


def run_mpqueue_pool(sizes: dict, reps: dict, warmup: int, gap: float, floor: MemcpyFloor) -> dict:
    ctx = tmp.get_context("spawn")
    to_consumer, to_producer = ctx.Queue(), ctx.Queue()
    max_bytes = max(sizes.values())
    pool = [{name: t.share_memory_() for name, t in make_batch(max_bytes, 0).items()} for _ in range(POOL)]
    proc = ctx.Process(target=_mpqueue_consumer, args=(to_consumer, to_producer, max_bytes))
    proc.start()
    out: dict = {}
    try:
        to_consumer.put(pool)
        assert to_producer.get(timeout=TIMEOUT_S) == "ready"
        seq, t_ack = 0, time.perf_counter()
        for label, nbytes in sizes.items():
            batch = make_batch(nbytes, 0)
            tokens = batch["hidden"].shape[0]
            out[label] = []
            for i in range(warmup + reps[label]):
                seq += 1
                batch["input_ids"][0] = seq
                batch["hidden"][-1, -1] = seq % 7
                entry = seq % POOL
                floor.sample(label, nbytes)
                _pace(t_ack, gap)
                t0 = time.perf_counter()
                for name, t in batch.items():
                    pool[entry][name][: t.shape[0]].copy_(t)
                to_consumer.put((seq, entry, tokens))
                ack = to_producer.get(timeout=TIMEOUT_S)
                t_ack = time.perf_counter()
                _check(list(ack), seq, "mpqueue_pool")
                if i >= warmup:
                    out[label].append(t_ack - t0)
        to_consumer.put(None)
    finally:
        proc.join(TIMEOUT_S)
        if proc.exitcode != 0:
            proc.kill()
            raise RuntimeError(f"mpqueue_pool consumer exited with status {proc.exitcode}")
    return out


class MemcpyFloor:
    """One copy of a batch into preallocated, touched memory, in the producer's process, timed once per
    batch of every variant (outside the timed span, while the consumer idles), so the floor is measured
    under the same load as the paths it bounds. Source and destination rotate through pairs that together
    exceed the last-level cache (COLD_SET): a small batch is copied from and to memory, as the ring's are."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}
        self._label, self._pairs, self._next = "", [], 0

    def sample(self, label: str, nbytes: int) -> None:
        if label != self._label:
            self._pairs = []  # free the previous size's buffers first
            self._pairs = [(make_batch(nbytes, 0), own_buffers(nbytes)) for _ in range(max(1, COLD_SET // nbytes))]
            for src, dest in self._pairs:  # touch every page once
                copy_out(dest, src)
            self._label, self._next = label, 0
        src, dest = self._pairs[self._next % len(self._pairs)]
        self._next += 1
        t0 = time.perf_counter()
        copy_out(dest, src)
        self.samples.setdefault(label, []).append(time.perf_counter() - t0)


def _serve(ctx: zmq.Context, workdir: str, mode: str, run, max_bytes: int, *args) -> dict:
    """One consumer process per variant, connected over a fresh ipc:// PAIR in a 0700 folder."""
    endpoint = f"ipc://{workdir}/{mode}.sock"
    sock = _pair(ctx, endpoint, bind=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.transport", "--consumer", mode, "--endpoint", endpoint]
    proc = subprocess.Popen([*cmd, "--max-bytes", str(max_bytes)], cwd=ROOT, env=env)
    try:
        return run(sock, *args)
    finally:
        sock.close()
        try:
            code = proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(TIMEOUT_S)
        if code != 0:
            raise RuntimeError(f"{mode} consumer exited with status {code}")


def layout_bytes(tokens: int, feature_dtype: str) -> int:
    """Bytes from a slot's start to the end of its last tensor: what one batch occupies."""
    last = plan_layout(slot_items(tokens, 1, WIDTH, feature_dtype))[-1]
    return last.offset + last.nbytes


def run_fp8(sizes: dict, reps: int) -> dict:
    """Bytes per batch bf16 vs FP8 (from the slot layout) and the quantise / dequantise times per batch."""
    out: dict = {"bytes_per_batch": {"bf16": {}, "fp8": {}}, "fp8_over_bf16_bytes": {}, "quantize_ms": {}}
    out["dequantize_ms"] = {}
    for label, nbytes in sizes.items():
        tokens = tokens_for(nbytes)
        bf16, fp8 = layout_bytes(tokens, "bfloat16"), layout_bytes(tokens, FP8)
        out["bytes_per_batch"]["bf16"][label], out["bytes_per_batch"]["fp8"][label] = bf16, fp8
        out["fp8_over_bf16_bytes"][label] = round(fp8 / bf16, 4)
        x = torch.randn(tokens, WIDTH).to(torch.bfloat16)
        views = {n: torch.empty(s, dtype=getattr(torch, d)) for n, d, s in slot_items(tokens, 1, WIDTH, FP8)}
        quant, dequant = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            quantize_rows(x, views["hidden"], views[SCALE])
            t1 = time.perf_counter()
            dequantize_rows(views["hidden"], views[SCALE], torch.bfloat16)
            quant.append(t1 - t0)
            dequant.append(time.perf_counter() - t1)
        out["quantize_ms"][label], out["dequantize_ms"][label] = _ms(quant), _ms(dequant)
    return out


def _ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def summarise(sizes: dict, ring: dict, mpq: dict, zcopy: dict, memcpy: dict, gap_ms: float) -> dict:
    e2e = {
        "ring": {k: _ms(v) for k, v in ring["e2e"].items()},
        "mpqueue_pool": {k: _ms(v) for k, v in mpq.items()},
        "zmqcopy": {k: _ms(v) for k, v in zcopy.items()},
    }
    ping_ms = _ms(ring["ping"])
    memcpy_ms = {k: _ms(v) for k, v in memcpy.items()}
    result: dict = {
        "e2e_ms": e2e,
        "memcpy_ms": memcpy_ms,
        "memcpy_gib_per_s": {k: round(sizes[k] / 2**30 / (v / 1e3), 2) for k, v in memcpy_ms.items()},
        "zmq_roundtrip_ms": ping_ms,
        "e2e_ms_two_copy_floor": {k: round(2 * v + ping_ms, 4) for k, v in memcpy_ms.items()},
        "ring_write_ms": {k: _ms(v) for k, v in ring["write"].items()},
        "ring_copy_out_ms": {k: _ms(v) for k, v in ring["copy_out"].items()},
        "gap_ms": gap_ms,
    }
    if "64MiB" in sizes:
        ring64 = e2e["ring"]["64MiB"]
        result["e2e_ratio_mpqueue_pool_over_ring_64MiB"] = round(e2e["mpqueue_pool"]["64MiB"] / ring64, 3)
        result["e2e_ratio_zmqcopy_over_ring_64MiB"] = round(e2e["zmqcopy"]["64MiB"] / ring64, 3)
        result["e2e_ring_over_two_copy_floor_64MiB"] = round(ring64 / result["e2e_ms_two_copy_floor"]["64MiB"], 3)
    if {"1MiB", "256MiB"} <= sizes.keys():
        result["e2e_growth_1_to_256MiB"] = round(e2e["ring"]["256MiB"] / e2e["ring"]["1MiB"], 1)
        result["memcpy_growth_1_to_256MiB"] = round(memcpy_ms["256MiB"] / memcpy_ms["1MiB"], 1)
        floor = result["e2e_ms_two_copy_floor"]
        result["two_copy_floor_growth_1_to_256MiB"] = round(floor["256MiB"] / floor["1MiB"], 1)
    met = {
        k: (result[k] >= bound if op == ">=" else result[k] <= bound)
        for k, (op, bound) in TARGETS.items()
        if k in result
    }
    result["targets"] = {k: f"{op} {bound}" for k, (op, bound) in TARGETS.items()}
    result["targets_met"] = met
    return result


def print_table(result: dict, sizes: dict) -> None:
    print(
        f"end-to-end medians in ms (write + hand-off + the consumer's own copy + release); every batch"
        f" follows {result['gap_ms']:g} ms of consumer idleness"
    )
    head = ["size", "ring", "mpq pool", "zmqcopy", "2-copy floor", "memcpy", "ring write", "ring copy"]
    print(" ".join(f"{h:>12}" for h in head))
    for label in sizes:
        cols = [
            result["e2e_ms"]["ring"],
            result["e2e_ms"]["mpqueue_pool"],
            result["e2e_ms"]["zmqcopy"],
            result["e2e_ms_two_copy_floor"],
            result["memcpy_ms"],
            result["ring_write_ms"],
            result["ring_copy_out_ms"],
        ]
        print(f"{label:>12} " + " ".join(f"{col[label]:>12.3f}" for col in cols))
    print(
        f"bare zmq round trip (64 B msgpack): {result['zmq_roundtrip_ms']:.3f} ms;"
        f" memcpy GiB/s {result['memcpy_gib_per_s']}"
    )
    for key in [
        k for k in result if k.startswith(("e2e_ratio", "e2e_growth", "memcpy_growth", "two_copy", "e2e_ring"))
    ]:
        bound = result["targets"].get(key)
        print(
            f"{key}: {result[key]}"
            + (f" (target {bound}: {'met' if result['targets_met'][key] else 'MISSED'})" if bound else "")
        )
    if "fp8" in result:
        f = result["fp8"]
        print("fp8 features: size, bytes per batch bf16 / fp8, fp8/bf16, quantise ms, dequantise ms")
        for label in sizes:
            print(
                f"{label:>12} {f['bytes_per_batch']['bf16'][label]:>12} {f['bytes_per_batch']['fp8'][label]:>12}"
                f" {f['fp8_over_bf16_bytes'][label]:>8.4f} {f['quantize_ms'][label]:>10.2f}"
                f" {f['dequantize_ms'][label]:>10.2f}"
            )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--quick", action="store_true", help="a quarter of the repetitions (noisier)")
    p.add_argument("--scale", type=float, default=None, help="multiply every repetition count")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"subset of {','.join(SIZES)}")
    p.add_argument("--gap-ms", type=float, default=30.0, help="consumer idle time before each timed batch")
    p.add_argument("--consumer", choices=["ring", "zmqcopy"], help=argparse.SUPPRESS)  # internal
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--max-bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.consumer == "ring":
        _ring_consumer(args.endpoint, args.max_bytes)
        return {}
    if args.consumer == "zmqcopy":
        _zmqcopy_consumer(args.endpoint)
        return {}

    unknown = [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown:
        p.error(f"--sizes: unknown {unknown}; choose from {','.join(SIZES)}")
    sizes = {label: SIZES[label] for label in args.sizes.split(",")}
    scale = args.scale or (0.25 if args.quick else 1.0)
    reps = {k: max(5, int(v * scale)) for k, v in REPS.items()}
    gap, warmup, max_bytes = args.gap_ms / 1e3, 3, max(sizes.values())
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="bench-transport-") as workdir:
        os.chmod(workdir, 0o700)
        floor = MemcpyFloor()
        ring = _serve(ctx, workdir, "ring", run_ring, max_bytes, sizes, reps, warmup, gap, floor)
        zcopy = _serve(ctx, workdir, "zmqcopy", run_zmqcopy, max_bytes, sizes, reps, warmup, gap, floor)
    ctx.term()
    mpq = run_mpqueue_pool(sizes, reps, warmup, gap, floor)
    result = summarise(sizes, ring, mpq, zcopy, floor.samples, args.gap_ms)
    result["reps"] = reps
    result["fp8"] = run_fp8(sizes, max(3, reps[min(reps)] // 10))
    print_table(result, sizes)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
