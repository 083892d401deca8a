"""GPU memory of a job's processes, planned on a CPU-only machine: the record both roles' planners emit, the
peak trackers they run their real code under (tracked_peak: a training step; frozen_peak: the frozen target's
forward), and the per-device sum launch.sh --dry-run prints.

Why fake tensors: `torch._subclasses.fake_tensor.FakeTensorMode` runs the model's own forward (and the drafter's
backward and AdamW step) with tensors that carry shape, dtype and storage size but no data, so a Qwen3.6-27B
shard or a 32k-row drafter step costs no memory and seconds of CPU. `torch.distributed._tools.mem_tracker.
MemTracker` counts every storage those ops create and free (parameters, gradients, optimizer state,
activations) and keeps the peak. Meta tensors alone give the weights but no timeline (nothing frees them);
MemTracker over fake tensors gives the peak of the real op sequence. What neither sees is below the tensors:
the CUDA context of each process on each GPU it touches (CUDA_CONTEXT_BYTES, an allowance) and the caching
allocator's fragmentation (the warning threshold leaves WARN_FRACTION of headroom for it).

    python -m producer memory-plan JOB [--target-config DIR] [--json]     the target ranks and their rings
    python -m consumer memory-plan JOB [--target-config DIR] [--json]     the drafter replicas
(launch.sh --dry-run runs each role's `plan`, its memory entries and its throughput work in one process:
common/role_plans.py)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

GIB = 2**30
# Allowance for one process's CUDA context on one GPU (driver state, kernel images with lazy loading, cuBLAS
# workspace): not a tensor, so no tracker sees it. bench/gpu_check.py's memory stage measures the real figure.
CUDA_CONTEXT_BYTES = 512 * 2**20
WARN_FRACTION = 0.92  # a device planned past this share of its memory is reported as over


@dataclass(frozen=True)
class ProcessMemory:
    """One process's planned peak on one device; parts name what the bytes are (weights, ring, step, ...)."""

    process: str
    device: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> ProcessMemory:
        return cls.from_dict(json.loads(line))

    @classmethod
    def from_dict(cls, d: dict) -> ProcessMemory:
        return cls(str(d["process"]), str(d["device"]), {str(k): int(v) for k, v in d["parts"].items()})


def tracked_peak(run: Callable[[], object], modules: Iterable = (), optimizers: Iterable = ()) -> int:
    """Peak bytes of every tensor storage alive while `run()` executes (call it inside a FakeTensorMode, or on
    real tensors), counting the given modules' parameters and buffers and the optimizers' states from the start."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*modules, *optimizers)
    with tracker:
        run()
    peaks = tracker.get_tracker_snapshot("peak")
    return int(sum(v["Total"] for dev, v in peaks.items() if isinstance(dev, torch.device)))


def frozen_peak(run: Callable[[], object], modules: Iterable = ()) -> int:
    """Peak bytes of every tensor storage alive while `run()` executes a forward of frozen modules (no parameter
    requires grad, as the producer loads its target), counting the modules' parameters and buffers from the start.

    MemTracker is a training tracker: it hooks every parameter's gradient, which a frozen parameter refuses, and
    every module input that requires grad (transformers 5.25 calls qwen3_5's causal conv through a `kernels`
    layer module whose input, a view of the conv weight, requires grad with no grad_fn under no_grad: its hook
    asserts). This counts storages alone: each one an op reads or writes, once, until it is freed."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class StoragePeak(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.refs: dict[int, weakref.ref] = {}  # id(storage) → a weak reference whose callback frees its bytes
            self.live = self.peak = 0

        def track(self, tensors: Iterable) -> None:
            for t in tensors:
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                if id(st) in self.refs:
                    continue
                n = st.nbytes()
                self.refs[id(st)] = weakref.ref(st, lambda _, key=id(st), n=n: self.free(key, n))
                self.live += n
            self.peak = max(self.peak, self.live)

        def free(self, key: int, n: int) -> None:
            if self.refs.pop(key, None) is not None:
                self.live -= n

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.track(tree_leaves((args, kwargs, out)))
            return out

    tracker = StoragePeak()
    tracker.track(t for m in modules for t in [*m.parameters(), *m.buffers()])
    with tracker:
        run()
    return tracker.peak


def device_totals(entries: Iterable[ProcessMemory]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for e in entries:
        totals[e.device] = totals.get(e.device, 0) + e.total
    return totals


def nvml_device_bytes() -> dict[str, int]:
    """cuda:i → total memory from NVML; {} where NVML is absent (this CPU-only machine)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound and friends: no GPU here
        return {}
    try:
        return {
            f"cuda:{i}": int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total)
            for i in range(pynvml.nvmlDeviceGetCount())
        }
    finally:
        pynvml.nvmlShutdown()


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def render(entries: list[ProcessMemory], sizes: dict[str, int], default_size: int | None) -> tuple[str, list[str]]:
    """The per-device table (each process's parts on it) and one warning per device planned over its memory."""
    lines, warnings = (
        ["planned GPU memory per device (peak; fake-tensor run of the real code, see common/memory_plan.py):"],
        [],
    )
    for dev, total in sorted(device_totals(entries).items(), key=lambda kv: _device_key(kv[0])):
        size = sizes.get(dev, default_size)
        of = f" of {gib(size)} ({100 * total / size:.0f} %)" if size else ""
        lines.append(f"  {dev}: {gib(total)}{of}")
        for e in (e for e in entries if e.device == dev):
            parts = ", ".join(f"{k} {gib(v)}" for k, v in e.parts.items() if v)
            lines.append(f"      {e.process:<24} {gib(e.total):>10}  {parts}")
        if size and total > WARN_FRACTION * size:
            largest = max((e for e in entries if e.device == dev), key=lambda e: e.total)
            warnings.append(
                f"WARNING: {dev} is planned at {gib(total)}, over {WARN_FRACTION:.0%} of its {gib(size)}"
                " (the rest is the caching allocator's headroom): the job would run out of memory there;"
                f" {largest.process} does not fit ({gib(largest.total)}): {what_to_change(largest.process)}"
            )
    if not sizes and default_size is None:
        lines.append("  (device sizes unknown: no NVML here; pass --device-memory GIB to check them)")
    return "\n".join(lines), warnings


def what_to_change(process: str) -> str:
    """The job-file keys that shrink a process's planned peak, by role (the names launch_plan gives them)."""
    if process.startswith("consumer-"):
        drafter = process[len("consumer-") :].rsplit("-r", 1)[0]
        return (
            'lower data.tokens_per_batch (the step\'s activations grow with it), or set distributed = "fsdp" on'
            f" drafter {drafter} (its weights, gradients and optimizer state split over its replicas) and raise"
            " its replicas"
        )
    return (
        "lower data.tokens_per_batch (the forward's activations and the ring's slots grow with it) or"
        " transport.slots, or raise target.tp_size (the weights split over more GPUs)"
    )


def _device_key(dev: str) -> tuple[str, int]:
    kind, _, idx = dev.partition(":")
    return kind, int(idx) if idx.isdigit() else -1
