"""CUDA backend of the slot ring: one dedicated allocation, exported by CUDA IPC as plain values.

Facts this follows (see reference/transport.md): an IPC handle covers the whole cudaMalloc block, so the
ring must be alone in its segment; expandable segments do not share reliably, so they are off while the
ring is allocated; each export must be rebuilt exactly once, or the producer's ref counter never drops;
device indexes differ between processes, so the GPU travels as its UUID. Importable without CUDA.
"""

from __future__ import annotations

import os

import torch

from common.ring_error import RingError

_MIN_ALLOC = 20 << 20  # below this the caching allocator carves requests out of a shared 20 MiB segment
_ROUND = 2 << 20  # large allocations are rounded to 2 MiB: ask for exactly that, so nothing is split off
_attached: set[tuple[bytes, int]] = set()  # (ref counter file, offset) of the exports rebuilt here
TORCH_FOR_ALLOCATOR_SETTINGS = "2.10"  # torch._C._accelerator_getAllocatorSettings (pytorch#165291, Oct 2025)


def allocate(nbytes: int, device: str | torch.device) -> torch.Tensor:
    """A zeroed uint8 tensor of at least `nbytes` in its own cudaMalloc segment on `device`."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RingError(f"a cuda ring needs a visible CUDA device, got device={str(device)!r}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    total = max(-(-nbytes // _ROUND) * _ROUND, _MIN_ALLOC)
    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):  # pyproject.toml's torch floor says so too
        raise RingError(
            f"a cuda ring needs torch >= {TORCH_FOR_ALLOCATOR_SETTINGS} (it turns expandable segments"
            " off around its allocation with torch._C._accelerator_get/setAllocatorSettings);"
            f" this is torch {torch.__version__}"
        )
    previous = torch._C._accelerator_getAllocatorSettings()
    expandable = "expandable_segments:true" in previous.replace(" ", "").lower()
    if expandable:
        torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
    try:
        torch.cuda.empty_cache()  # no cached free block to reuse: the ring gets a fresh cudaMalloc
        buf = torch.zeros(total, dtype=torch.uint8, device=device)
    finally:
        if expandable:
            torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    _check_dedicated_segment(buf)
    return buf


def _check_dedicated_segment(buf: torch.Tensor) -> None:
    ptr = buf.data_ptr()
    for seg in torch.cuda.memory.memory_snapshot():  # no history is recorded here: it carries no traces
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            if seg["address"] == ptr and seg["total_size"] == buf.numel():
                return
            raise RingError(
                f"the CUDA ring landed inside a {seg['total_size']}-byte allocator segment that its IPC"
                " handle would expose to consumers; create the ring before other allocations on its device"
            )
    raise RingError("the CUDA ring's allocator segment was not found: is a custom CUDA allocator active?")


_IPC_KEYS = ("ipc_device", "ipc_handle", "ipc_size", "ipc_offset")
_IPC_KEYS += ("ipc_ref_counter", "ipc_ref_offset", "ipc_event", "ipc_event_sync")
_IPC_TYPES = (int, bytes, int, int, bytes, int, bytes, bool)


def export(buf: torch.Tensor) -> dict:
    """A fresh export of the ring (new ref counter) as flat plain values, to be attached exactly once."""
    fields = buf.untyped_storage()._share_cuda_()
    uuid = str(torch.cuda.get_device_properties(buf.device).uuid)
    return {"gpu_uuid": uuid, **{k: t(v) for k, t, v in zip(_IPC_KEYS, _IPC_TYPES, fields, strict=True)}}


def local_index(gpu_uuid: str) -> int:
    """This process's index of the GPU named by UUID (CUDA_VISIBLE_DEVICES may renumber it)."""
    if not torch.cuda.is_available():
        raise RingError(f"the ring lives on GPU {gpu_uuid} but this process sees no CUDA device")
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    if gpu_uuid not in uuids:
        raise RingError(
            f"the ring's GPU {gpu_uuid} is not visible here (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}; visible: {uuids})"
        )
    return uuids.index(gpu_uuid)


def attach(handle: dict, total: int, device: str | None) -> torch.Tensor:
    """Rebuild the exported ring once; `device` is the consumer's own GPU, checked for peer access."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    for key, typ in zip(_IPC_KEYS, _IPC_TYPES, strict=True):
        if not isinstance(handle.get(key), typ) or (typ is int and isinstance(handle[key], bool)):
            raise RingError(f"ring handle: {key!r} must be {typ.__name__}, got {handle.get(key)!r:.60}")
    _dev, h, size, off, ref_h, ref_off, ev_h, ev_sync = (handle[k] for k in _IPC_KEYS)
    if size < total:
        raise RingError(f"ring handle: the shared storage holds {size} bytes, fewer than {total}")
    local = local_index(handle["gpu_uuid"])
    mine = torch.device(device) if device is not None else None
    peer = mine is not None and mine.type == "cuda" and mine.index not in (None, local)
    if peer and not torch.cuda.can_device_access_peer(mine.index, local):
        raise RingError(f"cuda:{mine.index} has no peer access to the ring's GPU cuda:{local}")
    if (ref_h, ref_off) in _attached:
        raise RingError("this ring export was already attached in this process; ask for a fresh handle")
    tensor = (torch.Tensor, (total,), (1,), 0, torch.storage.TypedStorage, torch.uint8, local)
    try:  # the signature of this torch's torch/multiprocessing/reductions.py
        buf = rebuild_cuda_tensor(*tensor, h, size, off, False, ref_h, ref_off, ev_h, ev_sync)
    except RuntimeError as e:
        raise RingError(f"opening the ring's CUDA IPC handle on cuda:{local} failed: {e}") from e
    _attached.add((ref_h, ref_off))
    return buf
