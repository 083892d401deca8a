"""The job file: one TOML document that every process of a job reads, its schema and its loading.

`load_job(path)` turns it into a tree of frozen pydantic models. Every error names the
key (dotted path) and the reason, so a bad job fails at start, not halfway through. The run folder's layout
is common/run_paths.py; the checks against the target's config.json on disk are common/target_probe.py (which
reads the job through its own JobView, so it does not import this module).
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import re
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from common import hub
from common.packed_batch import slot_feature_dtype
from common.run_paths import RunPaths
from common.target_probe import target_problem

DType = Literal["float32", "bfloat16", "float16"]
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
IPC_PATH_MAX = 107  # sun_path limit for ipc:// endpoints


class ConfigError(ValueError):
    """A job file that cannot run; the message names the file, the key and the reason."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class JobSection(_Section):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)] = "job"
    run_dir: str = "runs/job"
    seed: int = 0


class TargetConfig(_Section):
    path: str  # a local Hugging Face model directory, or a hub id ("Qwen/Qwen3-8B", from the HF cache: common/hub.py)
    revision: str | None = None  # a hub id's branch, tag or commit (default: main)
    dtype: DType = "bfloat16"
    device: str = "cpu"
    # auto: flex_attention on CUDA where the model supports it (block mask, no dense [T, T]), else sdpa, else eager
    attn_implementation: Literal["auto", "eager", "sdpa", "flex_attention", "packed_sdpa", "packed_eager"] = "auto"
    num_features: Annotated[int, Field(ge=1, le=64)] = 5
    layer_ids: list[Annotated[int, Field(ge=0)]] | None = None  # overrides the DFlash formula
    # tensor parallelism (producer/tp.py): one producer is a group of tp_size processes, rank 0 owns the ring
    tp_size: Annotated[int, Field(ge=1, le=64)] = 1
    # expert parallelism for a MoE target: 1 or tp_size, each rank of the group then holds 1/ep_size of the
    # experts whole instead of a slice of every expert (transformers' base_model_ep_plan, producer/tp.py)
    ep_size: Annotated[int, Field(ge=1, le=64)] = 1
    # target replicas: producers (each a TP group), each making its own batches of the node's plan, its own ring;
    # every consumer attaches to every one of them
    replicas: Annotated[int, Field(ge=1, le=64)] = 1
    # every rank's device: replicas × tp_size entries, replica r's rank k on devices[r·tp_size + k];
    # empty: every rank on `device`
    devices: list[str] = Field(default_factory=list)

    @field_validator("ep_size")
    @classmethod
    def _ep_is_the_tp_group(cls, ep: int, info: ValidationInfo) -> int:
        tp = info.data.get("tp_size", 1)
        if ep > 1 and ep != tp:
            raise ValueError(
                f"ep_size = {ep} with tp_size = {tp}: transformers needs ep_size to be a multiple of tp_size that"
                " divides fsdp_size × tp_size, and a producer's group runs one batch (fsdp_size 1), so ep_size is"
                f" 1 or tp_size ({tp})"
            )
        return ep

    @model_validator(mode="after")
    def _devices_match_ranks(self) -> TargetConfig:
        ranks = self.replicas * self.tp_size
        if self.devices and len(self.devices) != ranks:
            raise ValueError(f"devices lists {len(self.devices)} entries but replicas × tp_size is {ranks}")
        for r in range(self.replicas):
            devs = self.devices_of(r)
            kinds = {d.split(":")[0] for d in devs}
            if self.tp_size > 1 and (len(kinds) > 1 or not kinds <= {"cpu", "cuda"}):
                raise ValueError(f"a tensor-parallel group runs on CPUs or on CUDA devices, not {devs}")
            if (
                self.tp_size > 1
                and kinds == {"cuda"}
                and (len(set(devs)) != len(devs) or any(":" not in d for d in devs))
            ):
                raise ValueError(
                    f"every rank of a tensor-parallel group needs its own numbered CUDA device (cuda:N), not {devs}"
                )
        cuda = [d for d in self.devices if d.startswith("cuda")]
        if len(set(cuda)) != len(cuda):
            raise ValueError(f"devices {self.devices}: a CUDA device is listed twice (each rank needs its own)")
        return self

    def devices_of(self, replica: int) -> list[str]:
        """The device of each tensor-parallel rank of target replica `replica`; rank 0's holds its ring."""
        if not self.devices:
            return [self.device] * self.tp_size
        return list(self.devices[replica * self.tp_size : (replica + 1) * self.tp_size])


class DataConfig(_Section):
    # a .jsonl, .parquet or .arrow file (messages, ShareGPT conversations or prompt/response), or a hub dataset id
    path: str
    split: str = "train"  # a hub dataset's split
    subset: str | None = None  # a hub dataset's subset (its card's config name; default: the card's default)
    revision: str | None = None  # a hub dataset's branch, tag or commit
    format: Literal["chat", "prompt_response"] = "chat"
    tokenizer: str | None = None  # default: the target's directory; a local directory or a hub id
    # passed to every chat-template rendering, e.g. {enable_thinking = false}; regenerate with the same
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    max_length: Annotated[int, Field(ge=8)] = 2048
    tokens_per_batch: Annotated[int, Field(ge=8)] = 8192
    epochs: Annotated[int, Field(ge=1)] = 1
    length_group_window: Annotated[int, Field(ge=1)] = 64  # batches sorted by length within this window
    prefetch_batches: Annotated[int, Field(ge=1)] = 8  # tokenized batches kept ahead of the forward
    shard_by_node: bool = True  # multi-node jobs: each node reads its own disjoint shard
    # indexing skips (with file:line) a record over this size, so its peak memory never follows the largest
    # record; a sample is cut at max_length tokens, so nothing near this size is ever trained whole
    max_record_bytes: Annotated[int, Field(ge=1024)] = 16 << 20
    record_time_limit_s: Annotated[float, Field(gt=0)] = 60.0  # a safety net: encoding is linear in the record
    # the run folder's batch plan by name: a new name starts a new plan (changed data) from the drafters'
    # current weights, with a fresh cursor; a rerun of a changed plan under the same name is refused
    lineage: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)] = "main"
    # held-out records, never trained on: a record file in the training data's format, or a fraction in
    # (0, 0.5] of the data's records (a seeded split, part of the plan fingerprint); unset: no validation
    validation: str | float | None = None
    eval_every: Annotated[int, Field(ge=0)] = 200  # a validation pass after every N training batches; 0: none
    validation_max_records: Annotated[int, Field(ge=1)] = 256  # one pass evaluates at most this many records

    @field_validator("validation", mode="before")
    @classmethod
    def _fraction_or_path(cls, value: Any) -> Any:
        if isinstance(value, bool) or (isinstance(value, (int, float)) and not 0 < value <= 0.5):
            raise ValueError(f"{value!r}: a fraction of the records in (0, 0.5], or the path of a record file")
        if isinstance(value, str) and not value.strip():
            raise ValueError("an empty path: a fraction of the records in (0, 0.5], or the path of a record file")
        return float(value) if isinstance(value, int) else value

    @model_validator(mode="after")
    def _budget_holds_a_sequence(self) -> DataConfig:
        if self.tokens_per_batch < self.max_length:
            raise ValueError(
                f"tokens_per_batch ({self.tokens_per_batch}) is smaller than max_length ({self.max_length}):"
                " a full-length sample could never be packed"
            )
        return self


class TransportConfig(_Section):
    kind: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when the target runs on cuda
    slots: Annotated[int, Field(ge=2, le=256)] = 4
    slot_bytes: Annotated[int, Field(ge=0)] = 0  # 0: derived from the largest batch
    endpoint: Literal["ipc", "tcp"] = "ipc"
    tcp_host: str = "127.0.0.1"
    tcp_port: Annotated[int, Field(ge=0, le=65535)] = 0
    curve: bool | None = None  # CURVE-authenticate the tcp endpoint; unset: on unless tcp_host is loopback
    heartbeat_interval_s: Annotated[float, Field(gt=0)] = 1.0
    heartbeat_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    attach_timeout_s: Annotated[float, Field(gt=0)] = 600.0  # producer waits this long for every group
    on_dead_group: Literal["block", "skip"] = "block"
    # how the target features travel in a slot: "target" (the target's dtype) or "fp8" (e4m3, one float32
    # scale per row: 1 byte + 4/width per value; the consumer dequantises to the target's dtype)
    features: Literal["target", "fp8"] = "target"

    @model_validator(mode="after")
    def _timeout_covers_heartbeats(self) -> TransportConfig:
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be at least twice"
                f" heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        if self.curve and self.endpoint != "tcp":
            raise ValueError("curve = true needs endpoint = 'tcp' (an ipc endpoint is guarded by its 0700 folder)")
        if self.curve is False and self.endpoint == "tcp" and not is_loopback(self.tcp_host):
            raise ValueError(
                f"curve = false with tcp_host {self.tcp_host!r}: an endpoint outside loopback requires"
                " CURVE authentication (leave curve unset or set it true)"
            )
        return self

    @property
    def use_curve(self) -> bool:
        """Whether the control endpoint authenticates connections with CURVE (common/security.py)."""
        if self.endpoint != "tcp":
            return False
        return self.curve if self.curve is not None else not is_loopback(self.tcp_host)


# RoPE scalings a drafter may use (transformers' rope types with a fixed frequency table) and their required keys
ROPE_SCALINGS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
# and the optional keys that transformers, SGLang's and vLLM's get_rope all read the same way: yarn's
# attention_factor / mscale / mscale_all_dim / truncate are left out (transformers reads them, the engines'
# plain "yarn" reads attn_factor instead or ignores them: the drafter would be served with other cos/sin)
ROPE_OPTIONAL: dict[str, tuple[str, ...]] = {"linear": (), "llama3": (), "yarn": ("beta_fast", "beta_slow")}


def check_rope_scaling(scaling: dict) -> None:
    """ValueError naming the key when a drafter's rope_scaling is not one the export serves as trained."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_SCALINGS:
        raise ValueError(
            f"rope_scaling.rope_type {kind!r} is not one of {sorted(ROPE_SCALINGS)}"
            " (the rope types with a fixed frequency table)"
        )
    missing = [k for k in ROPE_SCALINGS[kind] if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} needs {missing}")
    allowed = {"rope_type", "type", *ROPE_SCALINGS[kind], *ROPE_OPTIONAL[kind]}
    extra = sorted(set(scaling) - allowed)
    if extra:
        raise ValueError(
            f"rope_scaling of type {kind!r}: unknown or unsupported key(s) {extra}; it takes {sorted(allowed - {'type'})}"
            " (keys SGLang and vLLM serve exactly as transformers trains them)"
        )
    for key in sorted(set(scaling) - {"rope_type", "type"}):
        value = scaling[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"rope_scaling.{key} must be a number, got {value!r}")
    if scaling["factor"] < 1:
        raise ValueError(
            f"rope_scaling.factor must be >= 1 (the context is stretched, not shrunk), got {scaling['factor']}"
        )
    original = scaling.get("original_max_position_embeddings")
    if original is not None and (not isinstance(original, int) or original < 1):
        raise ValueError(f"rope_scaling.original_max_position_embeddings must be a positive integer, got {original!r}")


SlidingBlockAttention = Literal["causal", "bidirectional"]


def default_sliding_block_attention(arch: str) -> SlidingBlockAttention:
    """The in-block rule of sliding layers that SGLang and vLLM serve today for this architecture's drafters
    (docs/design.md, "Sliding layers"): DFlash1 exports carry no `is_causal`, and both engines then make the
    block causal in sliding layers (as SpecForge trains it); z-lab's DFlash2 configs set `is_causal: false`,
    and both engines then let the block attend both ways (speculators' dflash2 default; SGLang from 0.5.18,
    every release with DFlash2, on its fa3, flashinfer and triton backends)."""
    return "bidirectional" if arch == "dflash2" else "causal"


class DrafterConfig(_Section):
    name: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=32)]
    block_size: Annotated[int, Field(ge=2, le=64)] = 16
    num_layers: Annotated[int, Field(ge=1, le=64)] = 5
    mask_token_id: int | None = None  # default: a spare vocab row or the tokenizer's mask/reserved token
    anchors_per_seq: Annotated[int, Field(ge=1)] = 512
    # the most anchors one batch trains on (a uniform cut of the per-sequence draws past it); None:
    # data.tokens_per_batch // 8, at least anchors_per_seq (consumer.objective.anchor_budget; docs/design.md
    # has the demo A/B of // 8, // 4 and every candidate up to 512 a sequence)
    anchors_per_batch: Annotated[int, Field(ge=1)] | None = None
    # the drafter's own RoPE (dflash.md §1), whatever the target's: base and an optional static scaling
    rope_theta: Annotated[float, Field(gt=0)] = 1e6
    rope_scaling: dict[str, float | int | str] | None = None  # e.g. {rope_type = "yarn", factor = 4.0, ...}
    # per-layer attention: None is every layer "full_attention"; "sliding_attention" needs sliding_window
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    sliding_window: Annotated[int, Field(ge=1)] | None = None
    # an anchor needs supervised tokens at p and p+1, its block may run past the sequence end (SpecForge);
    # false: the old rule, a whole block inside the sequence (p + B <= S)
    partial_blocks: bool = True
    gamma: Annotated[float, Field(gt=0)] | None = None  # loss = "decay" only: its decay; default from block_size
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    loss_chunk_rows: Annotated[int, Field(ge=16)] = 2048
    dtype: DType = "bfloat16"  # autocast dtype on GPU; CPU trains in float32
    lr: Annotated[float, Field(gt=0)] = 6e-4
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    warmup_frac: Annotated[float, Field(ge=0, lt=1)] = 0.04
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: Annotated[float, Field(gt=0)] = 1.0
    total_steps: Annotated[int, Field(ge=1)] = 10_000  # length of the lr schedule
    tokens_per_step: Annotated[int, Field(ge=0)] = 0  # accumulation target (0: a round a step); the last may be short
    replicas: Annotated[int, Field(ge=1, le=1024)] = 1
    devices: list[str] = Field(default_factory=list)  # one per replica; empty: every replica on "cpu"
    distributed: Literal["ddp", "fsdp"] = "ddp"
    checkpoint_every: Annotated[int, Field(ge=1)] = 500
    log_every: Annotated[int, Field(ge=1)] = 10
    max_nonfinite_steps: Annotated[int, Field(ge=1)] = 10
    seed: int | None = None  # default: the job seed
    # in sliding layers, may a block slot see the slots after it? None: the architecture's default
    # (default_sliding_block_attention). The export says it the way SGLang and vLLM read it (is_causal)
    sliding_block_attention: SlidingBlockAttention | None = None
    # a published drafter directory (config.json + safetensors, e.g. z-lab's) or one of our exports or
    # checkpoints to start from (consumer/warm_start.py); the job's own checkpoints, when any, win
    init_from: Annotated[str, Field(min_length=1)] | None = None
    # DFlash2 (z-lab dflash/model.py; consumer/dflash2.py): grouped dynamic causal convolutions around each
    # sublayer and a candidate selector over the full vocabulary; the five keys below apply to it only
    arch: Literal["dflash1", "dflash2", "dspark"] = "dflash1"
    conv_kernel_size: Annotated[int, Field(ge=1, le=16)] = 2  # taps per convolution (block-local)
    conv_group_size: Annotated[int, Field(ge=1)] = 16  # channels sharing one dynamic tap; divides hidden_size
    selector_rank: Annotated[int, Field(ge=1)] = 256  # r of the codebooks [V, r] and hidden_projection H -> r
    selector_top_k: Annotated[int, Field(ge=2)] = 16  # candidates per slot, the unary top-k
    # L = L_unary + selector_alpha · L_sel, both over the unary loss's weights and normaliser (docs/design.md)
    selector_alpha: Annotated[float, Field(ge=0)] = 1.0
    # DFlash2's optional serving keys (vLLM qwen3_dflash2.py, z-lab's configs): the unary logits the selector scores
    # are softcap(output_multiplier · h·Wᵀ) (a target whose own logits are scaled and capped), and only ids below
    # selector_vocab_size are candidates (the padded rows past the tokenizer never are). None: not set, or taken
    # from init_from's DFlash2 config when it states them (consumer/warm_start.py)
    output_multiplier: Annotated[float, Field(gt=0)] | None = None
    final_logit_softcapping: Annotated[float, Field(gt=0)] | None = None
    selector_vocab_size: Annotated[int, Field(ge=2)] | None = None
    # DSpark (DeepSpec config/dspark/dspark_qwen3_8b.py; consumer/dspark.py): DFlash1's backbone, each slot
    # predicting the token after its position (sample_from_anchor), plus a Markov head (markov_w2·markov_w1[prev]
    # added to the logits) and a confidence head; its loss is ce·CE + l1·L1 + confidence·BCE over exp(-k/γ)
    # slot weights (γ: `gamma`, default 4), normalised by Σw (`loss` and dpace_alpha do not apply)
    markov_rank: Annotated[int, Field(ge=1)] = 256
    confidence_with_markov: bool = True  # the confidence head reads [h ‖ markov_w1[prev]] (DeepSpec's default)
    dspark_ce_alpha: Annotated[float, Field(ge=0)] = 0.1
    dspark_l1_alpha: Annotated[float, Field(ge=0)] = 0.9
    dspark_confidence_alpha: Annotated[float, Field(ge=0)] = 1.0
    # the training loss (docs/recipes.md): "dpace" (D-PACE, arXiv 2605.18810: per-block weights from the
    # drafter's own confidence, w_k = Σ_{j>=k} m_j·Π_{i<=j} ((1-α)·q_i + α), no gradient; the step divides
    # Σ w·CE by the number of valid anchors (anchors with a supervised slot) of the whole optimizer step,
    # over every replica and accumulation round: gamma is ignored) or "decay" (the DFlash paper's
    # exp(-(k-1)/γ) weights, normalised by Σw over the step)
    loss: Literal["dpace", "decay"] = "dpace"
    dpace_alpha: Annotated[float, Field(gt=0, le=1)] = 0.5  # D-PACE smoothing α in (0, 1] (ModelOpt: 0.3-0.7)
    # what D-PACE's Σ w·CE of the step is divided by: "anchors" (its valid anchors) or "sequences" (its packed
    # sequences, as the D-PACE reference code divides by the batch size); docs/design.md, "D-PACE's normaliser"
    dpace_normaliser: Literal["anchors", "sequences"] = "anchors"
    # "muon" (the default: docs/recipes.md, the A/B): torch.optim.Muon for the hidden 2-D matrices, AdamW
    # (lr, betas, weight_decay) for the rest (consumer/optim.py), with any `distributed` (under "fsdp" on row
    # shards); "adamw": AdamW for everything
    optimizer: Literal["adamw", "muon"] = "muon"
    muon_lr: Annotated[float, Field(gt=0)] | None = None  # default: lr (match_rms_adamw makes AdamW's lr carry over)
    muon_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.95
    muon_weight_decay: Annotated[float, Field(ge=0)] = 0.1
    muon_ns_steps: Annotated[int, Field(ge=1, le=99)] = 5
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"

    @model_validator(mode="after")
    def _devices_match_replicas(self) -> DrafterConfig:
        if self.devices and len(self.devices) != self.replicas:
            raise ValueError(f"devices lists {len(self.devices)} entries but replicas is {self.replicas}")
        return self

    @model_validator(mode="after")
    def _attention_layout(self) -> DrafterConfig:
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers but num_layers is {self.num_layers}")
        sliding = "sliding_attention" in (self.layer_types or [])
        if sliding and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.sliding_window is not None and not sliding:
            raise ValueError("sliding_window is set but no layer in layer_types is sliding_attention")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
        return self

    @model_validator(mode="after")
    def _dflash2_taps_fit_a_block(self) -> DrafterConfig:
        if self.arch == "dflash2" and self.conv_kernel_size > self.block_size:
            raise ValueError(
                f"conv_kernel_size = {self.conv_kernel_size} is more taps than block_size ="
                f" {self.block_size} (a tap never crosses a block start)"
            )
        return self

    @property
    def attention_layers(self) -> list[str]:
        """The attention kind of each layer ("full_attention" or "sliding_attention")."""
        return list(self.layer_types) if self.layer_types is not None else ["full_attention"] * self.num_layers

    @property
    def loss_gamma(self) -> float:
        """The paper's decay constant: 7 for B=16, 5 for B=10, 4 for B=8; interpolated otherwise."""
        if self.gamma is not None:
            return self.gamma
        if self.arch == "dspark":
            return 4.0  # DeepSpec's loss_decay_gamma
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, self.block_size * 7.0 / 16.0))

    @property
    def block_attention(self) -> SlidingBlockAttention:
        """The in-block rule of this drafter's sliding layers (set, or its architecture's default)."""
        return self.sliding_block_attention or default_sliding_block_attention(self.arch)

    def device_of(self, replica: int) -> str:
        return self.devices[replica] if self.devices else "cpu"


class TelemetryConfig(_Section):
    interval_s: Annotated[float, Field(ge=0)] = 2.0  # publish period of every process; 0 disables profiling
    window_s: Annotated[float, Field(gt=0)] = 5.0  # aggregation window of the telemetry process
    stale_after_s: Annotated[float, Field(gt=0)] = 15.0
    nvml_interval_s: Annotated[float, Field(gt=0)] = 1.0
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    wandb_project: str = "dflash"
    wandb_entity: str | None = None
    wandb_queue: Annotated[int, Field(ge=1)] = 1024


class JobConfig(_Section):
    job: JobSection = Field(default_factory=JobSection)
    target: TargetConfig
    data: DataConfig
    transport: TransportConfig = Field(default_factory=TransportConfig)
    drafters: Annotated[list[DrafterConfig], Field(min_length=1)]
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> JobConfig:
        names = [d.name for d in self.drafters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"drafters: duplicate name(s) {dupes}")
        if self.transport.kind == "cuda" and not self.target.devices_of(0)[0].startswith("cuda"):
            raise ValueError(
                "transport.kind is 'cuda' but the target's rank 0 device (target.device or target.devices[0]) is not a CUDA device"
            )
        return self

    def drafter(self, name: str) -> DrafterConfig:
        for d in self.drafters:
            if d.name == name:
                return d
        raise ConfigError(f"no drafter named {name!r} in the job (have {[d.name for d in self.drafters]})")

    @property
    def transport_kind(self) -> Literal["cpu", "cuda"]:
        if self.transport.kind != "auto":
            return self.transport.kind
        return "cuda" if self.target.devices_of(0)[0].startswith("cuda") else "cpu"

    @property
    def slot_feature_dtype(self) -> str:
        """The dtype of `hidden` in a ring slot (transport.features: the target's, or FP8)."""
        return slot_feature_dtype(self.target.dtype, self.transport.features)

    @property
    def run_paths(self) -> RunPaths:
        return RunPaths(Path(self.job.run_dir))

    def ring_name(self, node: int, replica: int = 0) -> str:
        """The CPU ring's name for target replica `replica` of node `node`.

        It carries a hash of the run folder, so two jobs of one name in two folders (two demos, two users'
        test runs) never take each other's ring; a restart of the same job finds its stale ring.
        """
        folder = hashlib.blake2s(str(Path(self.job.run_dir).resolve()).encode(), digest_size=4).hexdigest()
        return f"{self.job.name}-{folder}-n{node}" + (f"p{replica}" if replica else "")


def is_loopback(host: str) -> bool:
    """A host that only this machine can reach: 127.0.0.0/8, ::1 or "localhost" (a name or "*" is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _format_error(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid job file ({err.error_count()} error(s))"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<top level>"
        msg = e["msg"].removeprefix("Value error, ")
        if key == "<top level>" and ": " in msg:  # cross-section checks name their key first
            key, msg = msg.split(": ", 1)
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + _nearest_key(e["loc"])
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif e["type"] == "literal_error":
            msg = _unknown_value(e["input"], (e.get("ctx") or {}).get("expected", ""))
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def _unknown_value(value: Any, expected: str) -> str:
    """A value an enumerated key does not take (a head, loss, optimizer ... this version does not know): the
    value, the nearest valid name, and every valid one."""
    names = re.findall(r"'([^']*)'", expected)
    close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown value {value!r}{hint}; this version knows: {', '.join(names)}"


def _section_keys(loc: tuple) -> list[str]:
    """The valid keys of the table at `loc` (a pydantic error location, list indexes included)."""
    model: Any = JobConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        pending = [field.annotation] if field else []
        model = None
        while pending:  # the section model inside Optional[...], list[...], Annotated[...]
            t = pending.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                model = t
                break
            pending += typing.get_args(t)
        if model is None:
            return []
    return list(model.model_fields)


def _nearest_key(loc: tuple) -> str:
    """`(did you mean 'block_size'?)` for a misspelt key; the table's keys when none is close."""
    keys = _section_keys(tuple(loc[:-1]))
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (the keys here: {', '.join(keys)})" if keys else ""


def parse_job(doc: dict, source: str = "<job>") -> JobConfig:
    try:
        job = JobConfig.model_validate(doc)
    except ValidationError as err:
        raise ConfigError(_format_error(source, err)) from None
    ipc_len = len(str((Path(job.job.run_dir) / "sockets" / "telemetry-out.sock").resolve()))
    if job.transport.endpoint == "ipc" and ipc_len > IPC_PATH_MAX:
        raise ConfigError(
            f"{source}: job.run_dir: socket paths under it would be {ipc_len} characters, over the"
            f" {IPC_PATH_MAX}-character limit of ipc:// endpoints; choose a shorter run_dir"
        )
    problem = target_problem(job)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    return job


def load_job(path: str | Path) -> JobConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read job file: {err.strerror}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return parse_job(_resolve_hub_ids(doc, str(path)), str(path))


def _resolve_hub_ids(doc: dict, source: str) -> dict:
    """Hub ids of the target and the tokenizer → their snapshot folders (downloaded first when online), and a
    hub dataset's split files fetched, so every check below sees local files (common/hub.py)."""
    target, data = doc.get("target"), doc.get("data")
    target = target if isinstance(target, dict) else {}
    data = data if isinstance(data, dict) else {}
    try:
        if isinstance(target.get("path"), str) and hub.is_hub_id(target["path"]):
            target = {**target, "path": hub.model_dir(target["path"], target.get("revision"), "target.path")}
        if isinstance(data.get("tokenizer"), str) and hub.is_hub_id(data["tokenizer"]):
            data = {**data, "tokenizer": hub.model_dir(data["tokenizer"], None, "data.tokenizer")}
        if isinstance(data.get("path"), str) and hub.is_hub_id(data["path"]):
            hub.dataset_files(data["path"], data.get("split", "train"), data.get("subset"), data.get("revision"))
    except hub.HubError as err:
        raise ConfigError(f"{source}: {err}") from None
    return {**doc, **({"target": target} if "target" in doc else {}), **({"data": data} if "data" in doc else {})}


def dflash_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """The DFlash default: ids[i] = round(1 + i*(N-4)/(n-1)); one feature → [N//2].

    A target too shallow for the formula to give distinct ids (tiny test models) gets ids spread evenly.
    """
    n_layers, n = num_target_layers, num_features
    if n == 1:
        return [n_layers // 2]
    ids = [round(1 + i * (n_layers - 4) / (n - 1)) for i in range(n)]
    if len(set(ids)) < n or n_layers < 5:
        ids = [round(i * (n_layers - 1) / (n - 1)) for i in range(n)]
    return ids
