"""Copying a batch out of its ring slot into the consumer's own buffers, so the slot can be released at once.

Ownership: the buffers are reused, never reallocated per batch. A batch handed out is valid until the next
`copy()` on the host side: the caller queues all its work on it before asking for the next one (the
trainer runs forward + backward at once, or, under FSDP where the forward waits for the group, copies
what it defers: consumer/trainer.py `accumulate`).

One CopyOut serves every producer a consumer reads (consumer/fanin.py): one batch is in flight at a time,
so a fan-in of R producers holds the sets of one stream, not R of them (consumer/memory_plan.py plans them).

CPU: one buffer set, synchronous copies. CUDA: two buffer sets used in turn and a copy stream per GPU
involved (the consumer's, and each ring's that is another one), so the copy of batch n+1 runs while the
training stream still computes on batch n:
- before a set is overwritten, the copy streams wait on an event the training stream recorded when the
  set's previous batch was given up (the next `copy()`): its step's kernels have read it by then;
- after the copies, an event on each copy stream; the host waits on those events only (the slot may be
  released and its seq tag read once they completed), never on the training stream. The events are
  blocking-sync ones: the waiting thread sleeps in the driver instead of spinning a core that the host's
  other threads (tokenizer prefetch, telemetry, the channel's I/O) need;
- the training stream waits on the consumer GPU's copy event before any work on the new batch;
- a buffer (re)allocated (first batches, a larger batch) comes from the training stream's pool, whose last
  user may still be queued there: the copy streams wait for the training stream once, then.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from common.config import JobConfig
from common.packed_batch import HOST_FIELDS


@dataclass
class BufferSet:
    """One set of copy-out buffers, by tensor name; `freed`: the training stream's event recorded when the
    batch it last held was given up (None: never handed out, or CPU)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    freed: torch.cuda.Event | None = None


class BufferSets:
    """`count` buffer sets used in turn (batch k lands in set k mod count); each buffer is allocated once at
    the largest size seen (at least `min_rows` rows) and sliced to the batch. Bookkeeping only."""

    def __init__(self, count: int, device: torch.device, min_rows: int, pin_host: bool):
        self.sets = [BufferSet() for _ in range(count)]
        self.device = device
        self.min_rows = min_rows
        self.pin_host = pin_host
        self.turn = -1  # index of the set handed out last

    def next_set(self) -> BufferSet:
        self.turn = (self.turn + 1) % len(self.sets)
        return self.sets[self.turn]

    def buffers_for(self, bufset: BufferSet, views: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
        """Buffers shaped like `views` in `bufset` (grown when a batch is larger than any before), and
        whether any was allocated now."""
        out, allocated = {}, False
        for name, view in views.items():
            buf = bufset.tensors.get(name)
            if (
                buf is None
                or buf.dtype != view.dtype
                or buf.shape[1:] != view.shape[1:]
                or buf.shape[0] < view.shape[0]
            ):
                rows = max(view.shape[0], self.min_rows)
                on_host = name in HOST_FIELDS  # sizes the step on the host: copied there, no device sync later
                buf = torch.empty(
                    (rows, *view.shape[1:]),
                    dtype=view.dtype,
                    device="cpu" if on_host else self.device,
                    pin_memory=on_host and self.pin_host,
                )
                bufset.tensors[name] = buf
                allocated = True
            out[name] = buf[: view.shape[0]]
        return out, allocated


def sets_for(cuda: bool) -> int:
    """Buffer sets a CopyOut keeps: two where a GPU is involved (copy of n+1 during the step on n), else one."""
    return 2 if cuda else 1


def copy_out_rows(job: JobConfig) -> int:
    """Rows each buffer is allocated with at first: the largest batch of the job (tokens_per_batch)."""
    return job.data.tokens_per_batch + 1


def planned_device_bytes(min_rows: int, feature_width: int, feature_itemsize: int, cuda: bool = True) -> int:
    """The device memory of a consumer's copy-out once its sets hold batches of up to `min_rows` tokens: the
    device fields (features, input_ids) of every set; the host fields live in (pinned) host memory."""
    row = feature_width * feature_itemsize + torch.empty((), dtype=torch.int64).element_size()
    return sets_for(cuda) * min_rows * row


class CopyOut:
    """Copies views of a slot (on a ring's device) into buffers on `device`; see the module docstring.

    `ring_device`: where the rings are (their kind decides the sets; a ring's GPU is read off each batch's views,
    so one CopyOut serves the rings of every producer)."""

    def __init__(self, device: torch.device, ring_device: torch.device, min_rows: int):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.cuda = device.type == "cuda" or ring_device.type == "cuda"
        self.sets = BufferSets(sets_for(self.cuda), device, min_rows, pin_host=self.cuda)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # a copy stream per GPU, made at its first batch
        self._tag = torch.empty(1, dtype=torch.int64, pin_memory=self.cuda)
        self._training = device.type == "cuda"  # the consumer's own GPU runs the step, on its current stream

    @property
    def streams(self) -> list[torch.cuda.Stream]:
        return list(self._streams.values())

    def _copy_streams(self, ring_device: torch.device) -> list[torch.cuda.Stream]:
        """The ring's GPU first, the consumer's last: inside copy() the consumer's GPU is the current device."""
        gpus = dict.fromkeys(d for d in (ring_device, self.device) if d.type == "cuda")
        for d in gpus:
            if d not in self._streams:
                self._streams[d] = torch.cuda.Stream(device=d)
        return [self._streams[d] for d in gpus]

    def copy(
        self, views: dict[str, torch.Tensor], tag: torch.Tensor | None
    ) -> tuple[dict[str, torch.Tensor], int | None]:
        """Copy `views` (and then the slot's seq `tag`) out; returns the buffers and the tag's value. When it
        returns, the reads of the slot are complete: the slot may be released."""
        previous = self.sets.sets[self.sets.turn] if self.sets.turn >= 0 else None
        if self._training and previous is not None:  # the batch handed out last is given up now
            previous.freed = torch.cuda.Event()
            previous.freed.record(torch.cuda.current_stream(self.device))
        bufset = self.sets.next_set()
        out, allocated = self.sets.buffers_for(bufset, views)
        if not self.cuda:
            for name, view in views.items():
                out[name].copy_(view)
            if tag is not None:
                self._tag.copy_(tag)
            return out, int(self._tag[0]) if tag is not None else None
        ring_device = next(iter(views.values())).device if views else self.device
        streams = self._copy_streams(ring_device)
        with contextlib.ExitStack() as on_copy_streams:
            for stream in streams:
                on_copy_streams.enter_context(torch.cuda.stream(stream))
                if bufset.freed is not None:
                    stream.wait_event(bufset.freed)  # the step that read this set's last batch is done
                if allocated and self._training:  # new memory comes from the training stream's pool: its
                    stream.wait_stream(torch.cuda.current_stream(self.device))  # last user's kernels first
            for name, view in views.items():
                out[name].copy_(view, non_blocking=True)
            if tag is not None:  # read after the data: a rewrite begun before this read has already changed it
                self._tag.copy_(tag, non_blocking=True)
            copied = [stream.record_event(torch.cuda.Event(blocking=True)) for stream in streams]
        for event in copied:
            event.synchronize()  # the copy streams only, sleeping (blocking event): the training stream keeps running
        if self._training:  # the consumer's copy stream is the last one
            torch.cuda.current_stream(self.device).wait_event(copied[-1])
        return out, int(self._tag[0]) if tag is not None else None


__all__ = ["BufferSet", "BufferSets", "CopyOut", "copy_out_rows", "planned_device_bytes", "sets_for"]
