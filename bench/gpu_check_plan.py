"""gpu_check's time and memory plan: each stage's budget (compile seconds and run seconds apart) and its planned
peak GPU memory, with the shapes of the memory-heavy stages sized to the device's memory.

The planned GiB are the memory planner's output (producer/ and consumer/memory_plan.py) at each shape, kept
here so `--plan` answers at once; `python -m bench.gpu_check --replan` recomputes them (CPU, ~1 min) and a
slow test checks them. A shape is chosen when its plan is within WARN_FRACTION of the device (the rest is the
caching allocator's fragmentation, as `launch.sh --dry-run` warns).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from common.memory_plan import WARN_FRACTION

TARGET = dict(
    hidden_size=4096, num_layers=36, heads=32, kv_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151_936
)
LAYER_IDS = [1, 9, 17, 25, 33]
PIPELINE_TARGET_LAYERS = 6  # the pipeline's target checkpoint: Qwen3-8B's layers, fewer of them (~4.5 GiB on disk)
PIPELINE_LAYER_IDS = [1, 2, 3, 4, 5]
DRAFTER = dict(num_layers=5, block_size=16)
EXPORT_TOKENS = 4096
MAX_LENGTH = 2048
H200_GIB = 139.7  # what NVML reports for one H200
CONTEXT_GIB = 0.5  # common.memory_plan.CUDA_CONTEXT_BYTES

# tokens per batch → planned GiB (Muon's state). The producer and consumer stages share one job (the same
# batches); the pipeline runs the target and two drafters on one GPU: its largest shape, 12,288, was chosen
# when 16,384 tokens planned 125.9 GiB there (90 % of an H200; 108.1 GiB since issue 34's bf16 norms)
STAGE_SHAPES = {
    16384: {"producer": 16.0, "consumer": 50.1},
    8192: {"producer": 15.0, "consumer": 31.3},
    4096: {"producer": 14.4, "consumer": 22.1},
}
PIPELINE_SHAPES = {12288: 88.3, 8192: 68.4, 7168: 63.4, 4096: 49.0}
FIXED_GIB = {"ipc": 2 * CONTEXT_GIB, "memory": CONTEXT_GIB, "assets": 5.0, "export": 8.1}


@dataclass(frozen=True)
class StagePlan:
    """A stage's budget: compile_s for start-up and cold compiles (a flex attention and block-mask compile at
    a new static shape costs tens of seconds, Triton's autotune a few), run_s for the measured work."""

    compile_s: int
    run_s: int
    what: str
    needs_ipc: bool = False  # two processes share CUDA memory (the slot ring): skipped where CUDA IPC fails

    @property
    def budget_s(self) -> int:
        return self.compile_s + self.run_s


# The budgets are estimates for one H200/H100 with the reasons given; the first run reports each stage's
# measured compile and run seconds beside them.
PLAN: dict[str, StagePlan] = {
    # two interpreters importing torch (~5 s each) and opening CUDA contexts; a 1 MiB block shared
    "ipc": StagePlan(0, 20, "CUDA IPC probe: a block exported by one process, mapped, read and written by another"),
    # the bundle's packages and every module the stages and the pipeline's processes import
    "imports": StagePlan(0, 15, "every module the stages and the pipeline's processes import, and their versions"),
    # ~25 CUDA tests, a few s each with Triton compiles; the rest is pytest's start. Memory: test shapes
    "tests": StagePlan(60, 60, "pytest on the CUDA test files only (Triton compiled; the ring between processes)"),
    "memory": StagePlan(0, 20, "one CUDA context measured by NVML against the planner's 512 MiB allowance"),
    # a 4.5 GiB target written at >= 0.5 GB/s, tokenizer and chats in seconds
    "assets": StagePlan(0, 40, "tokenizer, chats, 6-layer 8B-shaped target checkpoint (~4.5 GiB), job files"),
    # imports 10 s, weights 5 s, 4 warm-up forwards with flex compiles ~15 s; 10 timed forwards
    "producer": StagePlan(30, 30, "36-layer Qwen3-8B-shaped target built in GPU memory: tokens/s on unseen batches"),
    # imports 10 s, the loss kernels' autotune and flex compiles per (bucket, layer kind) ~40 s; 3 timed passes
    "consumer": StagePlan(50, 50, "5-layer block-16 drafter train_batch: tokens/s on unseen batches, NVML on/off"),
    # start-up (imports, load, compiles) <= 60 s, 40 s measured, the kill
    "pipeline": StagePlan(60, 50, "telemetry (NVML) + producer + 2 consumers on one GPU for 40 s", needs_ipc=True),
    # two steps at one new shape compile flex once
    "export": StagePlan(20, 10, "one-layer drafter exported and reloaded with AutoModel(trust_remote_code)"),
}
STAGE_LIMIT_S, TOTAL_LIMIT_S = 240, 540  # a 600 s device command: the rest for the bundle's install and start


@dataclass(frozen=True)
class Sizing:
    """The shapes for a device of `device_gib`: None where no shape of that stage fits."""

    device_gib: float
    stage_tokens: int | None
    pipeline_tokens: int | None

    @property
    def usable_gib(self) -> float:
        return round(WARN_FRACTION * self.device_gib, 1)

    def planned_gib(self, stage: str) -> float | None:
        """The stage's planned peak at these shapes; None for test shapes (unplanned) or no fitting shape."""
        if stage in FIXED_GIB:
            return FIXED_GIB[stage]
        if stage in ("producer", "consumer"):
            return None if self.stage_tokens is None else STAGE_SHAPES[self.stage_tokens][stage]
        if stage == "pipeline":
            return None if self.pipeline_tokens is None else PIPELINE_SHAPES[self.pipeline_tokens]
        return None

    def does_not_fit(self) -> dict[str, str]:
        """Stage → why it cannot run on this device at any planned shape."""
        out = {s: f"{g:.1f} GiB planned" for s, g in FIXED_GIB.items() if g > self.usable_gib}
        if self.stage_tokens is None:
            smallest = STAGE_SHAPES[min(STAGE_SHAPES)]
            out |= {s: f"{smallest[s]:.1f} GiB planned at {min(STAGE_SHAPES)} tokens" for s in smallest}
        if self.pipeline_tokens is None:
            out["pipeline"] = (
                f"{PIPELINE_SHAPES[min(PIPELINE_SHAPES)]:.1f} GiB planned at {min(PIPELINE_SHAPES)} tokens"
            )
        return {s: f"does not fit {self.device_gib:g} GiB ({why}; {self.usable_gib} usable)" for s, why in out.items()}


def size_for(device_gib: float) -> Sizing:
    """The largest planned shapes within WARN_FRACTION of `device_gib`: 139.7 (an H200) gives 16,384 tokens for
    the producer and consumer stages and 12,288 for the pipeline; 79 (an H100) keeps 16,384 and 8,192."""
    usable = WARN_FRACTION * device_gib
    stage = [t for t, g in STAGE_SHAPES.items() if max(g.values()) <= usable]
    pipe = [t for t, g in PIPELINE_SHAPES.items() if g <= usable]
    return Sizing(device_gib, max(stage, default=None), max(pipe, default=None))


def device_gib() -> float | None:
    """The visible CUDA device's memory in GiB (what NVML reports as total), None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)


def plan_text(sizing: Sizing, skip: set[str] | None = None) -> str:
    """One line per stage: compile, run and budget seconds, planned GiB at the chosen shape, what it runs."""
    skip, gone = skip or set(), sizing.does_not_fit()
    shapes = {
        "producer": sizing.stage_tokens,
        "consumer": sizing.stage_tokens,
        "pipeline": sizing.pipeline_tokens,
        "export": EXPORT_TOKENS,
    }
    lines = [
        f"  planned for {sizing.device_gib:g} GiB of GPU memory, each stage within {sizing.usable_gib} GiB"
        f" ({WARN_FRACTION:.0%})",
        "  stage     compile    run  budget   planned  what",
    ]
    for name, p in PLAN.items():
        gib = sizing.planned_gib(name)
        mem = "unplanned" if name == "tests" else "-" if gib is None else f"{gib:5.1f} GiB"
        note = f" at {shapes[name]:,} tokens" if shapes.get(name) else ""
        note += f"  [skipped: {gone[name]}]" if name in gone else "  [skipped by --skip]" if name in skip else ""
        lines.append(f"  {name:9s} {p.compile_s:5d} s {p.run_s:4d} s {p.budget_s:5d} s {mem:>9s}  {p.what}{note}")
    run = [n for n in PLAN if n not in skip and n not in gone]
    peak = max((sizing.planned_gib(n) or 0.0) for n in run) if run else 0.0
    lines.append(
        f"  total     {sum(PLAN[n].compile_s for n in run):5d} s {sum(PLAN[n].run_s for n in run):4d} s"
        f" {sum(PLAN[n].budget_s for n in run):5d} s  (each stage its own command; at most {STAGE_LIMIT_S} s a"
        f" stage, {TOTAL_LIMIT_S} s in all); largest stage {peak:.1f} of {sizing.device_gib:g} GiB"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the planner


def target_config():
    """The check's target (TARGET: Qwen3-8B's shape) as a transformers config, untied like Qwen3-8B."""
    from transformers import Qwen3Config

    t = TARGET
    return Qwen3Config(
        vocab_size=t["vocab_size"],
        hidden_size=t["hidden_size"],
        num_hidden_layers=t["num_layers"],
        num_attention_heads=t["heads"],
        num_key_value_heads=t["kv_heads"],
        head_dim=t["head_dim"],
        intermediate_size=t["intermediate_size"],
        tie_word_embeddings=False,
    )


def target_parts(path: Path, embed=None, lm_head=None):
    """The check's target (TARGET: Qwen3-8B's shape) as the drafter sees it; `embed`/`lm_head` None for planning."""
    from consumer.target_parts import TargetParts

    t = TARGET
    return TargetParts(
        path=path,
        hidden_size=t["hidden_size"],
        num_attention_heads=t["heads"],
        num_key_value_heads=t["kv_heads"],
        head_dim=t["head_dim"],
        intermediate_size=t["intermediate_size"],
        rms_norm_eps=1e-6,
        vocab_size=t["vocab_size"],
        num_hidden_layers=t["num_layers"],
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        embed_tokens=embed,
        lm_head=lm_head,
    )


def planned_memory() -> dict:
    """The planner's GiB at every shape of the tables above (producer/ and consumer/memory_plan.py, CPU, about
    a minute): `python -m bench.gpu_check --replan` prints it; a test checks the tables against it."""
    from common.config import DrafterConfig
    from common.memory_plan import CUDA_CONTEXT_BYTES, GIB
    from common.packed_batch import required_slot_bytes
    from consumer.memory_plan import step_peak
    from consumer.model import DrafterArch
    from producer.memory_plan import forward_peak, prefix_of_every_kind, weight_bytes

    t, text, parts, ctx = TARGET, target_config(), target_parts(Path(".")), CUDA_CONTEXT_BYTES

    def target(layers: int, tokens: int, slots: int) -> int:
        cut = copy.deepcopy(text)
        cut.num_hidden_layers = layers
        width = len(LAYER_IDS) * t["hidden_size"]
        return (
            weight_bytes(cut, "bfloat16")
            + forward_peak(prefix_of_every_kind(cut), "bfloat16", tokens)
            + slots * required_slot_bytes(tokens, width, "bfloat16")
        )

    def drafter(layers: int, tokens: int) -> int:
        cfg = DrafterConfig(name="d", block_size=DRAFTER["block_size"], num_layers=layers)
        arch = DrafterArch.from_target(parts, cfg, len(LAYER_IDS))
        return step_peak(arch, cfg, t["vocab_size"], False, tokens, MAX_LENGTH, "bfloat16", cuda=True)["peak"]

    def gib(nbytes: int) -> float:
        return round(nbytes / GIB, 1)

    small = copy.deepcopy(text)
    small.num_hidden_layers = PIPELINE_TARGET_LAYERS
    fixed = {
        "ipc": 2 * ctx,
        "memory": ctx,
        "assets": weight_bytes(small, "bfloat16") + t["vocab_size"] * t["hidden_size"] * 2 + ctx,  # + the LM head
        "export": drafter(1, EXPORT_TOKENS) + ctx,
    }
    stages = {
        n: {
            "producer": gib(target(max(LAYER_IDS) + 1, n, 1) + ctx),
            "consumer": gib(drafter(DRAFTER["num_layers"], n) + ctx),
        }
        for n in STAGE_SHAPES
    }
    pipeline = {
        n: gib(target(PIPELINE_TARGET_LAYERS, n, 4) + 2 * drafter(DRAFTER["num_layers"], n) + 3 * ctx)
        for n in PIPELINE_SHAPES
    }
    return {"fixed": {k: gib(v) for k, v in fixed.items()}, "stages": stages, "pipeline": pipeline}
