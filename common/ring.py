"""The slot ring: K fixed-size slots allocated once by the producer, attached once by each consumer.

Batches are handed over without copies: the producer writes tensors into a slot, sends the slot's layout
(a list of `TensorSpec`) in a BATCH message, and the consumer takes views into the same memory. Two backends
share one interface: a file in /dev/shm (CPU) or one dedicated CUDA allocation exported by CUDA IPC. The
handle that travels in WELCOME is a dict of plain values (msgpack-safe); nothing here pickles.

A header before slot 0 holds a magic, the geometry, the creator's pid and a random canary that the handle
also carries, so a consumer proves it opened the right memory without spending slot capacity.
"""

from __future__ import annotations

import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from common import ring_cuda
from common.packed_batch import SEQ_TAG, SLOT_ALIGN, aligned
from common.ring_error import RingError
from common.ring_file import ring_path

HEADER_BYTES = 4096  # one page before slot 0: keeps slot 0 page aligned
_HEADER = struct.Struct("<8sIIQQQ16s")  # magic, version, num_slots, slot_bytes, total_bytes, pid, canary
_MAGIC = b"DFRING01"
_VERSION = 1
_DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "float8_e4m3fn",
)
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in (*_DTYPE_NAMES, "bool")}
_MAX_DIMS = 8
_UNSEALED = object()  # a CUDA slot written since its last write_event
__all__ = [
    "DTYPES",
    "HEADER_BYTES",
    "SEQ_TAG",
    "RingError",
    "SlotRing",
    "TensorSpec",
    "layout_from_wire",
    "layout_to_wire",
    "plan_layout",
]


def _mib(n: int) -> str:
    """A byte count in the largest binary unit that keeps it ≥ 1 (a mistyped budget reads as TiB, not 10⁶ MiB)."""
    for unit, shift in (("TiB", 40), ("GiB", 30)):
        if n >= 1 << shift:
            return f"{n / 2**shift:.1f} {unit}"
    return f"{n / 2**20:.1f} MiB"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lives inside a slot; offset is in bytes from the slot's start.

    Layouts arrive off the wire, so every field is checked at construction; bounds against a slot are
    checked by `SlotRing.view`.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 0 < len(self.name) <= 64:
            raise RingError(f"layout entry name must be a 1-64 character string, got {self.name!r:.80}")
        if self.dtype not in DTYPES:
            raise RingError(
                f"layout entry {self.name!r}: unknown dtype {self.dtype!r:.40} (known: {', '.join(DTYPES)})"
            )
        shape = self.shape
        if not isinstance(shape, tuple) or len(shape) > _MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
            raise RingError(f"layout entry {self.name!r}: shape {shape!r:.80} must be at most {_MAX_DIMS} sizes >= 0")
        if not _is_int(self.offset) or self.offset < 0 or self.offset % SLOT_ALIGN:
            raise RingError(f"layout entry {self.name!r}: offset {self.offset!r:.40} is not a multiple of {SLOT_ALIGN}")

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n

    def to_wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset]

    @classmethod
    def from_wire(cls, obj: object) -> TensorSpec:
        if not isinstance(obj, list | tuple) or len(obj) != 4 or not isinstance(obj[2], list | tuple):
            raise RingError(f"layout entry must be [name, dtype, [sizes], offset], got {obj!r:.120}")
        name, dtype, shape, offset = obj
        return cls(name, dtype, tuple(shape), offset)


def plan_layout(items: list[tuple[str, str, tuple[int, ...]]]) -> list[TensorSpec]:
    """Lay (name, dtype, shape) items out one after another at SLOT_ALIGN-aligned offsets."""
    layout, end = [], 0
    for name, dtype, shape in items:
        if dtype not in DTYPES:
            raise RingError(f"tensor {name!r} has dtype {dtype}, which the ring cannot carry")
        spec = TensorSpec(name, dtype, tuple(shape), aligned(end))
        layout.append(spec)
        end = spec.offset + spec.nbytes
    return layout


def layout_to_wire(layout: list[TensorSpec]) -> list[list]:
    return [spec.to_wire() for spec in layout]


def layout_from_wire(obj: object) -> list[TensorSpec]:
    if not isinstance(obj, list | tuple) or len(obj) > 64:
        raise RingError(f"layout must be a list of at most 64 entries, got {type(obj).__name__}")
    return [TensorSpec.from_wire(entry) for entry in obj]


class SlotRing:
    """K slots of `slot_bytes` each; created by the producer (`create`) or opened by a consumer (`attach`)."""

    def __init__(self, kind: str, buf: torch.Tensor, num_slots: int, slot_bytes: int, canary: bytes, *, owner: bool):
        self.kind = kind
        self.owner = owner  # the creator: removes the file / collects IPC blocks at close
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.canary = canary
        self._buf: torch.Tensor | None = buf  # uint8 [total_bytes]: the whole ring, alive until close()
        self._path: Path | None = None  # CPU creator only: the file it removes at close
        self._inode = 0
        self._events: list = [None] * num_slots  # CUDA creator only: write-completion events
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the whole ring viewed as each dtype
        self.path: str | None = None

    # ---- creation (producer) ----
    @classmethod
    def create(
        cls,
        kind: str,
        num_slots: int,
        slot_bytes: int,
        *,
        name: str,
        device: str = "cpu",
        shm_dir: str = "/dev/shm",
    ) -> SlotRing:
        if kind not in ("cpu", "cuda"):
            raise RingError(f"ring kind must be 'cpu' or 'cuda', got {kind!r}")
        if not _is_int(num_slots) or num_slots < 1 or not _is_int(slot_bytes) or slot_bytes < 1:
            raise RingError(f"ring needs num_slots >= 1 and slot_bytes >= 1, got {num_slots!r}, {slot_bytes!r}")
        slot_bytes = aligned(slot_bytes)
        canary = secrets.token_bytes(16)
        if kind == "cpu":
            return cls._create_shm(num_slots, slot_bytes, canary, ring_path(shm_dir, name))
        buf = ring_cuda.allocate(HEADER_BYTES + num_slots * slot_bytes, device)
        ring = cls("cuda", buf, num_slots, slot_bytes, canary, owner=True)
        ring._write_header(buf.numel())
        torch.cuda.synchronize(buf.device)
        return ring

    @classmethod
    def _create_shm(cls, num_slots: int, slot_bytes: int, canary: bytes, path: Path) -> SlotRing:
        total = HEADER_BYTES + num_slots * slot_bytes
        _remove_stale(path)
        try:
            st = os.statvfs(path.parent)
        except OSError as e:
            raise RingError(f"shared-memory folder {path.parent} is not usable: {e}") from e
        free = st.f_bavail * st.f_frsize
        if total > free:
            raise RingError(
                f"{path.parent} has {_mib(free)} free but the ring needs {_mib(total)} ({num_slots} slots x"
                f" {_mib(slot_bytes)} + header; a slot holds one batch of data.tokens_per_batch tokens unless"
                " transport.slot_bytes is set): free space there, lower data.tokens_per_batch or transport.slots,"
                " or give the container a larger --shm-size"
            )
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise RingError(f"{path} appeared while creating the ring: another producer of this job?") from None
        try:
            try:  # allocates every tmpfs page now: a full tmpfs is ENOSPC here, never SIGBUS later
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                raise RingError(f"reserving {_mib(total)} in {path} failed ({e.strerror}); {_mib(free)} free") from e
            inode = os.fstat(fd).st_ino
            buf = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
            buf[:: os.sysconf("SC_PAGE_SIZE")].fill_(0)  # map every page writable in this process up front
            ring = cls("cpu", buf, num_slots, slot_bytes, canary, owner=True)
            ring._write_header(total)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        ring._path, ring._inode, ring.path = path, inode, str(path)
        return ring

    def _write_header(self, total: int) -> None:
        header = _HEADER.pack(_MAGIC, _VERSION, self.num_slots, self.slot_bytes, total, os.getpid(), self.canary)
        self._ring()[: _HEADER.size].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))

    def handle(self) -> dict:
        """Flat plain values (str, int, bytes) for WELCOME. CUDA: every call is a fresh export, to be
        attached exactly once (one call per consumer)."""
        buf = self._ring()
        common = dict(version=_VERSION, kind=self.kind, num_slots=self.num_slots, slot_bytes=self.slot_bytes)
        common.update(total_bytes=buf.numel(), canary=self.canary)
        if self.kind == "cpu":
            return {**common, "path": self.path}
        return {**common, **ring_cuda.export(buf)}

    # ---- attaching (consumer) ----
    @classmethod
    def attach(cls, handle: dict, *, device: str | None = None) -> SlotRing:
        """Open the ring named by a WELCOME handle and check its canary. `device`: the consumer's CUDA
        device, used to check peer access to the ring's GPU (CUDA rings only)."""
        if not isinstance(handle, dict):
            raise RingError(f"ring handle must be a dict, got {type(handle).__name__}")
        if handle.get("kind") not in ("cpu", "cuda") or handle.get("version") != _VERSION:
            raise RingError(f"ring handle: unsupported kind/version {handle.get('kind')!r}/{handle.get('version')!r}")
        want = dict.fromkeys(("num_slots", "slot_bytes", "total_bytes"), int)
        want.update(canary=bytes, **(dict(path=str) if handle["kind"] == "cpu" else dict(gpu_uuid=str)))
        for key, typ in want.items():
            if not isinstance(handle.get(key), typ) or isinstance(handle.get(key), bool):
                raise RingError(f"ring handle: {key!r} must be {typ.__name__}, got {handle.get(key)!r:.60}")
        num_slots, slot_bytes, total = handle["num_slots"], handle["slot_bytes"], handle["total_bytes"]
        if num_slots < 1 or slot_bytes < 1 or total < HEADER_BYTES + num_slots * slot_bytes:
            raise RingError(f"ring handle: {num_slots} slots x {slot_bytes} B do not fit {total} B")
        if slot_bytes % SLOT_ALIGN or total % SLOT_ALIGN:
            raise RingError(f"ring handle: slot_bytes and total_bytes must be multiples of {SLOT_ALIGN}")
        buf = _attach_shm(handle["path"], total) if handle["kind"] == "cpu" else ring_cuda.attach(handle, total, device)
        ring = cls(handle["kind"], buf, num_slots, slot_bytes, handle["canary"], owner=False)
        ring.path = handle.get("path")
        ring._verify_header(total)
        if ring.kind == "cpu":
            int(buf[:: os.sysconf("SC_PAGE_SIZE")].sum())  # fault every page in now, not on the first batch
        return ring

    def _verify_header(self, total: int) -> None:
        raw = bytes(self._ring()[: _HEADER.size].cpu().numpy())
        magic, version, num_slots, slot_bytes, size, _pid, canary = _HEADER.unpack(raw)
        where = self.path or "the CUDA ring"
        if magic != _MAGIC or version != _VERSION:
            raise RingError(f"{where} is not a slot ring of version {_VERSION} (magic {magic!r})")
        if canary != self.canary:
            raise RingError(f"{where}: canary mismatch: the memory opened is not the ring this handle names")
        if (num_slots, slot_bytes, size) != (self.num_slots, self.slot_bytes, total):
            raise RingError(
                f"{where}: header says {num_slots} slots x {slot_bytes} B in {size} B, handle says"
                f" {self.num_slots} x {self.slot_bytes} in {total}"
            )

    # ---- data ----
    def begin_write(self, slot: int, layout: list[TensorSpec]) -> dict[str, torch.Tensor]:
        """The producer's write, first half: views of `slot` as `layout` places a batch, the seq tag (when
        the layout has one) set to -1 before any other byte changes, so a consumer still reading the slot's
        previous batch sees it change. The caller fills views (the target forward writes the features)."""
        end = max((s.offset + s.nbytes for s in layout), default=0)
        if end > self.slot_bytes:
            sizes = ", ".join(f"{s.name}={s.nbytes}" for s in layout)
            raise RingError(
                f"batch needs {end} bytes ({sizes}, aligned to {SLOT_ALIGN}) but a slot holds {self.slot_bytes}"
            )
        views = self.view(slot, layout)
        if SEQ_TAG in views:
            views[SEQ_TAG].fill_(-1)
        if self.kind == "cuda":
            self._events[slot] = _UNSEALED
        return views

    def end_write(self, slot: int, views: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], seq: int) -> None:
        """Second half: copy `tensors` into their views (CUDA: asynchronous, on the current stream), set the
        seq tag to `seq` and mark the end of the writes; publish once `is_written(slot)`."""
        cuda = self.kind == "cuda"
        for name, t in tensors.items():
            views[name].copy_(t, non_blocking=cuda)
        if SEQ_TAG in views:
            views[SEQ_TAG].fill_(seq)
        self.write_event(slot)

    def write_event(self, slot: int) -> None:
        """Mark the end of a slot's writes (CUDA: an event on the current stream; CPU: writes are done)."""
        self._check_slot(slot)
        if self.kind == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._ring().device))
            self._events[slot] = event

    def is_written(self, slot: int) -> bool:
        """Whether the slot's writes completed; polls, never synchronises."""
        self._check_slot(slot)
        event = self._events[slot]
        if event is _UNSEALED:
            raise RingError(f"slot {slot} was written but write_event({slot}) was not called")
        return event is None or event.query()

    @property
    def device(self) -> torch.device:
        """Where the ring's memory lives (cpu, or the ring's GPU as this process numbers it)."""
        return self._ring().device

    def view(self, slot: int, layout: list[TensorSpec]) -> dict[str, torch.Tensor]:
        """Views into `slot` as `layout` describes; the layout came off the wire, so bounds are checked."""
        self._check_slot(slot)
        views: dict[str, torch.Tensor] = {}
        for spec in layout:
            if not isinstance(spec, TensorSpec):
                raise RingError(f"layout entries must be TensorSpec (see layout_from_wire), got {spec!r:.60}")
            if spec.offset + spec.nbytes > self.slot_bytes:
                raise RingError(
                    f"layout entry {spec.name!r} spans bytes {spec.offset}..{spec.offset + spec.nbytes} of a"
                    f" {self.slot_bytes}-byte slot"
                )
            if spec.name in views:
                raise RingError(f"layout names {spec.name!r} twice")
            views[spec.name] = self._tensor(slot, spec)
        return views

    def _tensor(self, slot: int, spec: TensorSpec) -> torch.Tensor:
        dtype = DTYPES[spec.dtype]
        whole = self._typed.get(dtype)
        if whole is None:  # the ring reinterpreted once per dtype: one as_strided per view afterwards
            whole = self._typed[dtype] = self._ring().view(dtype)
        strides, step = [], 1
        for size in reversed(spec.shape):
            strides.append(step)
            step *= size
        start = (HEADER_BYTES + slot * self.slot_bytes + spec.offset) // dtype.itemsize
        return whole.as_strided(spec.shape, strides[::-1], start)

    def _check_slot(self, slot: int) -> None:
        self._ring()
        if not _is_int(slot) or not 0 <= slot < self.num_slots:
            raise RingError(f"slot {slot!r} is outside the ring's {self.num_slots} slots")

    def _ring(self) -> torch.Tensor:
        if self._buf is None:
            raise RingError("the ring is closed")
        return self._buf

    # ---- teardown ----
    def close(self) -> None:
        """Drop this process's view; the creator also removes the file (CPU) or collects IPC blocks (CUDA)."""
        if self._buf is None:
            return
        self._buf, self._events, self._typed = None, [None] * self.num_slots, {}
        if self._path is not None:
            try:
                if os.stat(self._path).st_ino == self._inode:  # never remove a newer producer's ring
                    os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None
        if self.owner and self.kind == "cuda":
            torch.cuda.ipc_collect()

    def __enter__(self) -> SlotRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remove_stale(path: Path) -> None:
    """Remove a ring file left by a crashed producer; refuse if its creator still runs."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except FileNotFoundError:
        return
    if len(raw) == _HEADER.size and raw[:8] == _MAGIC:
        pid = _HEADER.unpack(raw)[5]
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            pass
        except PermissionError:
            raise RingError(f"{path} belongs to running pid {pid} of another user") from None
        else:
            raise RingError(f"{path} belongs to running pid {pid}: is another producer of this job running?")
    os.unlink(path)


def _attach_shm(path: str, total: int) -> torch.Tensor:
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise RingError(f"ring file {path} does not exist: the producer is gone or runs on another host") from None
    if size != total:
        raise RingError(f"ring file {path} holds {size} bytes, the handle says {total}")
    return torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
