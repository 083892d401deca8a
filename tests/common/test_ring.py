"""The slot ring across real processes: a child attaches through a msgpack handle and checks every byte."""

import hashlib
import os
import select
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import msgpack
import pytest
import torch

from common.packed_batch import SEQ_TAG, SLOT_ALIGN
from common.ring import (
    HEADER_BYTES,
    RingError,
    SlotRing,
    TensorSpec,
    layout_from_wire,
    layout_to_wire,
    plan_layout,
)
from common.ring_file import ring_path

ROOT = Path(__file__).resolve().parents[2]
SHM = "/dev/shm"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The consumer side: framed msgpack requests on stdin, framed replies on stdout; nothing is pickled.
CHILD = r"""
import hashlib, struct, sys
import msgpack, torch
from common.ring import RingError, SlotRing, layout_from_wire

def digest(t):
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()

def recv():
    (n,) = struct.unpack("<I", sys.stdin.buffer.read(4))
    return msgpack.unpackb(sys.stdin.buffer.read(n))

def send(obj):
    data = msgpack.packb(obj)
    sys.stdout.buffer.write(struct.pack("<I", len(data)) + data)
    sys.stdout.buffer.flush()

ring = copier = None
while True:
    req = recv()
    try:
        if req["op"] == "attach":
            ring = SlotRing.attach(req["handle"], device=req.get("device"))
            send({"ok": True})
        elif req["op"] == "copy_out":  # as consumer/stream.py copies a batch out (consumer/copy_out.py)
            from consumer.copy_out import CopyOut
            dev = torch.device(req["device"])
            torch.cuda.set_device(dev)  # the reader's own GPU is the current one, as in a consumer
            if copier is None:
                copier = CopyOut(dev, ring.device, 1)
            views = ring.view(req["slot"], layout_from_wire(req["layout"]))
            for bufset in copier.sets.sets:
                for t in bufset.tensors.values():
                    t.reshape(-1).view(torch.uint8).fill_(0xAB)  # stale bytes, should the copy not have landed
            torch.cuda.synchronize(dev)
            with torch.cuda.device(ring.device):  # the ring GPU's default stream is busy: the copies must not
                torch.cuda._sleep(req["sleep_cycles"])  # be queued there, behind it, unwaited for
            out, _ = copier.copy(views, None)
            host = {k: digest(t) for k, t in out.items() if t.device.type == "cpu"}  # read now, no device sync
            send({"ok": True, "host": host, "device": {k: digest(t) for k, t in out.items()}})
        elif req["op"] == "digest":
            views = ring.view(req["slot"], layout_from_wire(req["layout"]))
            send({"ok": True, "digests": {k: digest(v) for k, v in views.items()},
                  "device": str(next(iter(views.values())).device)})
        elif req["op"] == "exit":
            if ring is not None:
                ring.close()
            send({"ok": True})
            break
    except RingError as e:
        send({"ok": False, "error": str(e)})
"""


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


class Child:
    """A separate Python process speaking the framed protocol above; every read has a timeout."""

    def __init__(self, timeout: float = 60.0):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env
        )
        self.timeout = timeout

    def ask(self, **req) -> dict:
        data = msgpack.packb(req)
        self.proc.stdin.write(struct.pack("<I", len(data)) + data)
        self.proc.stdin.flush()
        (n,) = struct.unpack("<I", self._read(4))
        return msgpack.unpackb(self._read(n))

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
            if not ready:
                raise TimeoutError(f"child gave no reply within {self.timeout} s")
            chunk = os.read(self.proc.stdout.fileno(), n - len(out))
            if not chunk:
                raise EOFError(f"child exited with status {self.proc.wait(self.timeout)}")
            out += chunk
        return out

    def exit(self) -> int:
        assert self.ask(op="exit")["ok"]
        return self.proc.wait(self.timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(self.timeout)


@pytest.fixture
def child():
    c = Child()
    yield c
    c.kill()


@pytest.fixture
def name():
    n = f"test-{uuid.uuid4().hex[:12]}"
    yield n
    ring_path(SHM, n).unlink(missing_ok=True)


DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.int32]


def random_batch(gen: torch.Generator, count: int) -> dict[str, torch.Tensor]:
    """`count` tensors of mixed dtypes and random shapes (0-d and empty included)."""
    batch = {"hidden": torch.randn(150, 64, generator=gen).bfloat16()}  # most of a 32 KiB slot
    batch["cu_seqlens"] = torch.randint(0, 150, (5,), generator=gen, dtype=torch.int32)  # a consumer's host field
    for i in range(count):
        dtype = DTYPES[i % len(DTYPES)]
        ndim = int(torch.randint(0, 4, (1,), generator=gen))
        shape = tuple(int(s) for s in torch.randint(0, 7, (ndim,), generator=gen))
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=gen).to(dtype)
        else:
            hi = 256 if dtype == torch.uint8 else 2**31 - 1
            t = torch.randint(0, hi, shape, generator=gen, dtype=torch.int64).to(dtype)
        batch[f"t{i}_{str(dtype).removeprefix('torch.')}"] = t
    return batch


def write(ring: SlotRing, slot: int, tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    """The producer's write path (producer/service.py): begin_write, copies, end_write."""
    layout = plan_layout([(k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in tensors.items()])
    views = ring.begin_write(slot, layout)
    ring.end_write(slot, views, tensors, seq=slot)
    return layout


def write_round(ring: SlotRing, gen: torch.Generator) -> list[tuple[int, list, dict]]:
    """Fill every slot; returns (slot, wire layout, expected digests) per slot."""
    rounds = []
    for slot in range(ring.num_slots):
        batch = random_batch(gen, 12)
        layout = write(ring, slot, batch)
        rounds.append((slot, layout_to_wire(layout), {k: digest(v) for k, v in batch.items()}))
    for slot in range(ring.num_slots):
        while not ring.is_written(slot):  # CUDA: the producer polls the event, never synchronises
            pass
    return rounds


def check_ring_across_processes(ring: SlotRing, child: Child) -> None:
    gen = torch.Generator().manual_seed(0)
    assert child.ask(op="attach", handle=ring.handle()) == {"ok": True}
    for _ in range(2):  # the second round overwrites every slot: the child must see the new bytes
        for slot, layout, expected in write_round(ring, gen):
            reply = child.ask(op="digest", slot=slot, layout=layout)
            assert reply["ok"], reply
            assert reply["digests"] == expected
            assert reply["device"].startswith(ring.kind)
    bad = [["x", "float32", [ring.slot_bytes // 4], SLOT_ALIGN]]  # ends one alignment past the slot
    reply = child.ask(op="digest", slot=0, layout=bad)
    assert not reply["ok"] and "spans bytes" in reply["error"]
    reply = child.ask(op="digest", slot=ring.num_slots, layout=[])
    assert not reply["ok"] and "outside" in reply["error"]
    assert child.exit() == 0


def test_cpu_ring_crosses_processes(name, child):
    ring = SlotRing.create("cpu", 3, 32 << 10, name=name, shm_dir=SHM)
    path = Path(ring.path)
    assert path.parent == Path(SHM) and path.stat().st_size == HEADER_BYTES + 3 * (32 << 10)
    check_ring_across_processes(ring, child)
    assert path.exists(), "an attaching process must never remove the ring file"
    ring.close()
    assert not path.exists()
    ring.close()  # idempotent


def test_canary_mismatch_is_rejected(name):
    with SlotRing.create("cpu", 2, 4096, name=name) as ring:
        handle = ring.handle()
        with pytest.raises(RingError, match="canary mismatch"):
            SlotRing.attach({**handle, "canary": bytes(16)})
        with pytest.raises(RingError, match="header says 2 slots"):
            SlotRing.attach({**handle, "num_slots": 1})
        with pytest.raises(RingError, match="unsupported kind"):
            SlotRing.attach({**handle, "kind": "disk"})
        with pytest.raises(RingError, match="'canary' must be bytes"):
            SlotRing.attach({**handle, "canary": "x"})
        with pytest.raises(RingError, match="multiples of 256"):
            SlotRing.attach({**handle, "total_bytes": handle["total_bytes"] + 8})
        with pytest.raises(RingError, match="does not exist"):
            SlotRing.attach({**handle, "path": f"{SHM}/dflash-ring-no-such-{name}"})
        SlotRing.attach(handle).close()


def test_layout_out_of_bounds_is_rejected(name):
    with SlotRing.create("cpu", 2, 1024, name=name) as ring:
        ok = TensorSpec("h", "float32", (256,), 0)  # exactly one slot
        assert ring.view(1, [ok])["h"].shape == (256,)
        for spec in [TensorSpec("h", "float32", (257,), 0), TensorSpec("h", "uint8", (1,), 1024)]:
            with pytest.raises(RingError, match="spans bytes"):
                ring.view(1, [spec])
        with pytest.raises(RingError, match="twice"):
            ring.view(0, [ok, ok])
        for slot in (-1, 2, True, 1.0):
            with pytest.raises(RingError, match="outside"):
                ring.view(slot, [ok])


@pytest.mark.parametrize(
    "entry, reason",
    [
        (["h", "float32", [4], 0, 1], "must be"),
        (["", "float32", [4], 0], "name"),
        (["h", "complex64", [4], 0], "unknown dtype"),
        (["h", "float32", [-1], 0], "shape"),
        (["h", "float32", [True], 0], "shape"),
        (["h", "float32", [1] * 9, 0], "shape"),
        (["h", "float32", [4], 3], "offset"),
        (["h", "float32", [4], -256], "offset"),
        (["h", "float32", "4", 0], "must be"),
    ],
)
def test_bad_wire_layout_entries_are_rejected(entry, reason):
    with pytest.raises(RingError, match=reason):
        TensorSpec.from_wire(entry)


def test_layout_round_trips_through_msgpack():
    layout = [TensorSpec("hidden", "bfloat16", (3, 8), 0), TensorSpec("ids", "int64", (), 256)]
    assert layout_from_wire(msgpack.unpackb(msgpack.packb(layout_to_wire(layout)))) == layout
    with pytest.raises(RingError, match="at most 64"):
        layout_from_wire([layout[0].to_wire()] * 65)


def test_batch_that_does_not_fit_names_the_sizes(name):
    with SlotRing.create("cpu", 1, 1024, name=name) as ring:
        write(ring, 0, {"a": torch.zeros(200, dtype=torch.uint8), "b": torch.zeros(768, dtype=torch.uint8)})
        with pytest.raises(RingError, match=r"needs 1025 bytes \(a=200, b=769"):
            write(ring, 0, {"a": torch.zeros(200, dtype=torch.uint8), "b": torch.zeros(769, dtype=torch.uint8)})
        with pytest.raises(RingError, match="complex64"):
            write(ring, 0, {"c": torch.zeros(2, dtype=torch.complex64)})
        assert ring.is_written(0)


def test_the_seq_tag_is_invalid_between_begin_and_end_of_a_write(name):
    layout = plan_layout([("x", "float32", (4,)), (SEQ_TAG, "int64", (1,))])
    with SlotRing.create("cpu", 1, 1024, name=name) as ring:
        views = ring.begin_write(0, layout)
        assert int(views[SEQ_TAG][0]) == -1
        ring.end_write(0, views, {"x": torch.arange(4.0)}, seq=7)
        assert int(ring.view(0, layout)[SEQ_TAG][0]) == 7
        assert torch.equal(ring.view(0, layout)["x"], torch.arange(4.0))
        views = ring.begin_write(0, layout)  # a rewrite: a late reader of seq 7 sees the tag change first
        assert int(ring.view(0, layout)[SEQ_TAG][0]) == -1


def test_full_shm_fails_at_create_with_sizes(name):
    st = os.statvfs(SHM)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(RingError, match=r"iB free but the ring needs .* [MGT]iB .*--shm-size"):
        SlotRing.create("cpu", 2, free // 2 + (64 << 20), name=name, shm_dir=SHM)
    assert not ring_path(SHM, name).exists()


def test_stale_ring_of_a_dead_producer_is_replaced(name):
    crash = f"from common.ring import SlotRing; import os; SlotRing.create('cpu', 2, 4096, name={name!r}); os._exit(3)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert subprocess.run([sys.executable, "-c", crash], cwd=ROOT, env=env, timeout=60).returncode == 3
    assert ring_path(SHM, name).exists()
    with SlotRing.create("cpu", 3, 4096, name=name) as ring:  # the restarted producer
        assert ring.num_slots == 3
        with pytest.raises(RingError, match=f"running pid {os.getpid()}"):
            SlotRing.create("cpu", 3, 4096, name=name)
        assert Path(ring.path).exists()
    assert not ring_path(SHM, name).exists()


def test_closed_ring_refuses_use(name):
    ring = SlotRing.create("cpu", 1, 256, name=name)
    ring.close()
    with pytest.raises(RingError, match="closed"):
        ring.view(0, [])
    with pytest.raises(RingError, match="closed"):
        ring.handle()


def test_bad_create_arguments(name):
    with pytest.raises(RingError, match="name"):
        SlotRing.create("cpu", 1, 256, name="../etc")
    with pytest.raises(RingError, match="kind"):
        SlotRing.create("disk", 1, 256, name=name)
    with pytest.raises(RingError, match="num_slots"):
        SlotRing.create("cpu", 0, 256, name=name)
    with SlotRing.create("cpu", 1, 1, name=name) as ring:
        assert ring.slot_bytes == SLOT_ALIGN


@pytest.mark.cuda
@requires_cuda
def test_cuda_ring_crosses_processes(name, child):
    ring = SlotRing.create("cuda", 3, 32 << 10, name=name, device="cuda:0")
    try:
        check_ring_across_processes(ring, child)
    finally:
        ring.close()


@pytest.mark.cuda
@requires_cuda
def test_cuda_canary_mismatch_is_rejected(name, child):
    ring = SlotRing.create("cuda", 2, 4096, name=name, device="cuda:0")
    try:
        used = ring.handle()  # every handle() is a fresh export, to be rebuilt exactly once
        reply = child.ask(op="attach", handle={**used, "canary": bytes(16)})
        assert not reply["ok"] and "canary mismatch" in reply["error"]
        reply = child.ask(op="attach", handle={**used, "gpu_uuid": "GPU-not-here"})
        assert not reply["ok"] and "not visible" in reply["error"]
        assert child.ask(op="attach", handle=ring.handle()) == {"ok": True}
        with pytest.raises(RingError, match="write_event"):
            ring.begin_write(0, plan_layout([("x", "float32", (4,))]))
            ring.is_written(0)
        assert child.exit() == 0
    finally:
        ring.close()


@pytest.mark.cuda
@pytest.mark.parametrize(
    "reader",
    [
        pytest.param("cuda:0", marks=requires_cuda, id="same-gpu"),
        pytest.param(
            "cuda:1", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"), id="other-gpu"
        ),
    ],
)
def test_cuda_ring_copy_out_is_complete_once_copy_returns(name, child, reader):
    """Ring on cuda:0 in this process; the reader process copies each slot out (consumer/copy_out.py: to its
    GPU, cu_seqlens-like host fields to pinned memory) while the ring GPU's default stream is held back by a
    sleep kernel: when copy() returns every byte must be the slot's (copies queued on that default stream
    would still be pending behind the sleep)."""
    ring = SlotRing.create("cuda", 2, 32 << 10, name=name, device="cuda:0")
    try:
        gen = torch.Generator().manual_seed(1)
        assert child.ask(op="attach", handle=ring.handle(), device=reader) == {"ok": True}
        for slot, layout, expected in write_round(ring, gen):
            reply = child.ask(op="copy_out", slot=slot, layout=layout, device=reader, sleep_cycles=300_000_000)
            assert reply["ok"], reply
            assert reply["device"] == expected
            assert reply["host"] == {"cu_seqlens": expected["cu_seqlens"]}
        assert child.exit() == 0
    finally:
        ring.close()


def test_ring_modules_do_not_import_each_other_in_a_circle():
    """common.ring_cuda is imported by common.ring, never the other way round (both use common.ring_error)."""
    code = "import common.ring_cuda, sys; assert 'common.ring' not in sys.modules, 'ring_cuda imports ring'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_cuda_handle_is_validated_before_any_cuda_call():
    handle = dict(version=1, kind="cuda", num_slots=2, slot_bytes=4096, total_bytes=20 << 20, canary=bytes(16))
    with pytest.raises(RingError, match="'gpu_uuid' must be str"):
        SlotRing.attach(handle)
    with pytest.raises(RingError, match="'ipc_handle' must be bytes"):
        SlotRing.attach({**handle, "gpu_uuid": "GPU-x", "ipc_device": 0, "ipc_handle": "not bytes"})
    with pytest.raises(RingError, match="do not fit"):
        SlotRing.attach({**handle, "gpu_uuid": "GPU-x", "total_bytes": 4096})
