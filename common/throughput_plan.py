"""Time per batch of each stage of a job, its bottleneck and its samples/s, planned from shapes and the device's
published peak (launch.sh --dry-run prints it after the memory plan).

Each role counts the work of its own stages at the job's shapes (`python -m producer throughput-plan`,
`python -m consumer throughput-plan`, or `python -m ROLE plan` with the memory plan in one process:
common/role_plans.py; common/flop_model.py's arithmetic on the shapes the memory plan builds) and emits one
`Work` line per stage: per batch, on one process of the stage, amounts of three resources: matmul FLOPs (at
MFU × the device's dense bf16 peak), HBM bytes and link bytes (at BANDWIDTH_FRACTION of the published
bandwidth). A stage's processes share its batches (the target replicas make every other batch; a drafter's
replicas train every R-th), and every batch passes every stage once (each batch goes to one replica of every
drafter), so the job runs at the slowest stage's rate.

The hand-off is its own stage: the producer's ring GPU sends each batch's features to one replica of every
drafter (NVLink between GPUs, HBM on the same GPU, PCIe through a host ring); the consumers' double buffers
overlap it with training, so it limits the job only when it is the slowest stage.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

# SpecForge's measured MFU on 8×H200 (reference/dflash.md §5): trainer 43.5–44.1 %, target prefill ≈ 43 %
DEFAULT_MFU = 0.45
BANDWIDTH_FRACTION = 0.8  # of a published HBM bandwidth; the NVLink figure below is already a measured one
# the most of a drafter replica's time the optimizer step should take (issue 34): above it the plan names the
# tokens_per_step that brings it under (Newton–Schulz is paid once a step, the forward and backward every batch)
MAX_OPTIMIZER_SHARE = 0.15


@dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float  # dense bf16 FLOP/s, published
    hbm: float  # B/s
    nvlink: float  # B/s one direction, GPU to GPU
    pcie: float  # B/s host ↔ device
    memory_gib: float


DEVICES = {
    "h200": Device("H200 SXM", 989e12, 4.8e12, 375e9, 50e9, 141),
    "h100": Device("H100 SXM", 989e12, 3.35e12, 375e9, 50e9, 80),
}


def infer_device(kind: str | None, device_memory_gib: float | None) -> tuple[Device, str]:
    """The named kind, else the one whose memory is nearest `--device-memory`, else H100; and how it was chosen."""
    if kind:
        return DEVICES[kind], f"--device {kind}"
    if device_memory_gib:
        best = min(DEVICES, key=lambda k: abs(DEVICES[k].memory_gib - device_memory_gib))
        return DEVICES[best], f"inferred from --device-memory {device_memory_gib:g}"
    return DEVICES["h100"], "assumed (pass --device h100|h200)"


@dataclass(frozen=True)
class Work:
    """One stage's work per batch on one of its processes: parts name (resource, amount), resource one of
    "flops", "hbm", "nvlink", "pcie"."""

    stage: str
    processes: int  # processes that share the stage's batches
    parts: dict[str, tuple[str, float]] = field(default_factory=dict)
    note: str = ""
    per_step: float = 1.0  # batches a process trains per optimizer step
    step_parts: tuple[str, ...] = ()  # parts paid once a step (given per batch: already divided by per_step)

    def to_json(self) -> str:
        return json.dumps({"work": asdict(self)})

    @classmethod
    def from_json(cls, line: str) -> Work:
        return cls.from_dict(json.loads(line)["work"])

    @classmethod
    def from_dict(cls, d: dict) -> Work:
        parts = {str(k): (str(r), float(a)) for k, (r, a) in d["parts"].items()}
        steps = (float(d.get("per_step", 1.0)), tuple(map(str, d.get("step_parts", ()))))
        return cls(str(d["stage"]), int(d["processes"]), parts, str(d.get("note", "")), *steps)


@dataclass(frozen=True)
class Reference:
    samples_per_s: float
    mean_sample_tokens: int | None  # the published run's mean, to plan at; None: not published
    source: str


# published figures of the setups the shipped examples mirror, by job name
REFERENCES = {
    "qwen3-8b-8xh200": Reference(
        50.1,
        540,  # 27,000 tokens/s ÷ 50 samples/s in the same report
        "SpecForge docs/benchmarks/domino-disaggregated-performance.md: Qwen3-8B, 8×H200, 1 capture server"
        " + 7 FSDP trainers, ≈1.1B Domino/DFlash-family drafter, 256 anchors × block 16",
    ),
    "qwen36-27b-8gpu": Reference(
        10.65,
        None,
        "SpecForge DFlash2 on a 27B target, 8×H200, capture-bound (reference/recipes.md); its split and"
        " sample lengths are not published",
    ),
}


def rates(device: Device, mfu: float) -> dict[str, float]:
    return {
        "flops": device.bf16_flops * mfu,
        "hbm": device.hbm * BANDWIDTH_FRACTION,
        "nvlink": device.nvlink,
        "pcie": device.pcie,
    }


def part_seconds(work: Work, rate: dict[str, float]) -> dict[str, float]:
    return {name: amount / rate[res] for name, (res, amount) in work.parts.items()}


def optimizer_share(work: Work, rate: dict[str, float], per_step: float | None = None) -> float:
    """The share of a process's time per batch spent in the parts named "optimizer…", at `per_step` batches
    a step (default: the work's own)."""
    scale = work.per_step / (per_step or work.per_step)
    secs = {n: s * (scale if n in work.step_parts else 1.0) for n, s in part_seconds(work, rate).items()}
    total = sum(secs.values())
    return sum(s for n, s in secs.items() if n.startswith("optimizer")) / total if total else 0.0


def optimizer_line(work: Work, rate: dict[str, float], tokens_per_batch: int) -> str | None:
    """The optimizer's share of a drafter replica's step; above MAX_OPTIMIZER_SHARE, the tokens_per_step
    (whole batches a replica) that brings it under. None for a stage without an optimizer."""
    if not any(n.startswith("optimizer") and a for n, (_, a) in work.parts.items()):
        return None
    share = optimizer_share(work, rate)
    line = f"optimizer: {100 * share:.0f} % of a replica's time per batch"
    if share <= MAX_OPTIMIZER_SHARE:
        return f"{line} (at most {100 * MAX_OPTIMIZER_SHARE:.0f} %)"
    k = next(
        (
            k
            for k in range(math.floor(work.per_step) + 1, 1 << 16)
            if optimizer_share(work, rate, k) <= MAX_OPTIMIZER_SHARE
        ),
        None,
    )
    if k is None:  # an optimizer part paid every batch: a longer step does not help
        return f"{line}, above {100 * MAX_OPTIMIZER_SHARE:.0f} %"
    return (
        f"{line}, above {100 * MAX_OPTIMIZER_SHARE:.0f} %: tokens_per_step = {k * work.processes * tokens_per_batch:,}"
        f" ({k} batches a replica a step) brings it to {100 * optimizer_share(work, rate, k):.0f} %"
    )


def _amount(res: str, amount: float) -> str:
    return f"{amount / 1e12:.2f} TFLOP" if res == "flops" else f"{amount / 1e9:.2f} GB {res}"


def render(
    works: list[Work],
    device: Device,
    how: str,
    mfu: float,
    tokens_per_batch: int,
    sample_tokens: int,
    sample_how: str,
    reference: Reference | None,
) -> str:
    """The per-stage table, the bottleneck and the job's rates."""
    rate = rates(device, mfu)
    lines = [
        f"planned throughput per batch of {tokens_per_batch:,} tokens (common/throughput_plan.py), device"
        f" {device.name} ({how}): {device.bf16_flops / 1e12:.0f} TFLOP/s dense bf16 at an assumed MFU of"
        f" {mfu:.0%}, HBM {device.hbm / 1e12:.2f} TB/s at {BANDWIDTH_FRACTION:.0%}, NVLink"
        f" {device.nvlink / 1e9:.0f} GB/s a direction, PCIe {device.pcie / 1e9:.0f} GB/s:",
        f"  {'stage':<24} {'procs':>5} {'ms/batch':>9} {'batches/s':>9}  parts (per batch, one process)",
    ]
    stage_rates = {}
    for w in works:
        secs = part_seconds(w, rate)
        total = sum(secs.values())
        stage_rates[w.stage] = w.processes / total if total else float("inf")
        parts = ", ".join(
            f"{name} {1e3 * s:.1f} ms ({100 * s / total:.0f} %, {_amount(*w.parts[name])})"
            for name, s in secs.items()
            if w.parts[name][1]
        )
        lines.append(f"  {w.stage:<24} {w.processes:>5} {1e3 * total:>9.1f} {stage_rates[w.stage]:>9.2f}  {parts}")
        if w.note:
            lines.append(f"  {'':<24} {'':>5} {'':>9} {'':>9}  ({w.note})")
        if share := optimizer_line(w, rate, tokens_per_batch):
            lines.append(f"  {'':<24} {'':>5} {'':>9} {'':>9}  {share}")
    bottleneck = min(stage_rates, key=stage_rates.get)
    batches = stage_rates[bottleneck]
    samples = batches * tokens_per_batch / sample_tokens
    lines.append(
        f"bottleneck: {bottleneck} at {batches:.2f} batches/s; the job: {batches * tokens_per_batch:,.0f} tokens/s,"
        f" {samples:.1f} samples/s at {sample_tokens:,}-token samples ({sample_how})"
    )
    if reference:
        lines.append(
            f"published: {reference.samples_per_s} samples/s against our predicted {samples:.1f} ({reference.source})"
        )
    return "\n".join(lines)


def sample_length(job, sample_tokens: int | None) -> tuple[int, str]:
    """The samples' mean length the plan's samples/s is at, and where it comes from: --sample-tokens, else the
    published run's mean, else data.max_length; at most a batch."""
    reference = REFERENCES.get(job.job.name)
    if sample_tokens:
        how = "--sample-tokens"
    elif reference and reference.mean_sample_tokens:
        sample_tokens, how = reference.mean_sample_tokens, "the published run's mean"
    else:
        sample_tokens, how = job.data.max_length, "data.max_length: every sample full; --sample-tokens to change"
    return min(sample_tokens, job.data.tokens_per_batch), how


def throughput_report(
    job,
    works: list[Work],
    sample: tuple[int, str],
    kind: str | None,
    device_memory_gib: float | None,
    mfu: float = DEFAULT_MFU,
) -> str:
    """Both roles' work (the Work lines of their `plan` commands, common/role_plans.py), rendered at `sample`
    (sample_length's)."""
    device, device_how = infer_device(kind, device_memory_gib)
    return render(works, device, device_how, mfu, job.data.tokens_per_batch, *sample, REFERENCES.get(job.job.name))
