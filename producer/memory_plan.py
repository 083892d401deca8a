"""The producer's GPU memory at the job's real shapes, planned without a GPU (common/memory_plan.py says how).

Per target rank: the weights of the decoder cut after its last captured layer (producer/target.py loads exactly
that, without the final norm of a cut decoder), counted on the meta device; the forward's transient peak over a
fake-tensor run of the model's own forward on a packed batch of tokens_per_batch tokens, the model frozen and
run under inference_mode as the producer runs it (common.memory_plan.frozen_peak counts its storages); the ring
(slots × slot bytes) on rank 0's device; a CUDA context. A tensor-parallel rank is planned as the model with
1/tp of the attention heads, KV heads, linear-attention heads and MLP width (and 1/ep of the experts under
expert parallelism): the shapes transformers' TP plan gives each rank, the residual stream replicated.

The forward's activations grow linearly with the tokens of a batch (no [T, T] tensor on CUDA: flex or sdpa),
so above FIT_TOKENS the peak is measured at two batch sizes and extended along that line; the fake run of a
chunked linear-attention fallback at 16k tokens would take minutes, the two runs take seconds.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel, PretrainedConfig

from common.config import JobConfig, dflash_layer_ids
from common.fp8 import CHUNK
from common.launch_plan import producer_name
from common.memory_plan import CUDA_CONTEXT_BYTES, ProcessMemory, frozen_peak
from common.packed_batch import ITEM_BYTES, required_slot_bytes
from common.role_plans import PlanInputError, plan_command
from common.target_keys import set_layer_count
from common.target_probe import EXPERT_COUNT_KEYS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FIT_TOKENS = (512, 1024)  # batch sizes the forward is measured at when tokens_per_batch is larger
TP_SPLIT_KEYS = (
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "shared_expert_intermediate_size",
)


class TargetConfigError(PlanInputError, ValueError):
    """No usable target config.json; the message names the path."""


def read_text_config(path: str | Path) -> PretrainedConfig:
    """The text config of the target at `path` (a model directory or its config.json)."""
    path = Path(path)
    folder = path.parent if path.name == "config.json" else path
    if not (folder / "config.json").is_file():
        raise TargetConfigError(
            f"{folder}/config.json: not found (the memory plan needs the target's config; pass"
            " --target-config DIR where the model is not on this machine)"
        )
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True).get_text_config()
    except (OSError, ValueError, KeyError) as err:
        raise TargetConfigError(f"{folder}/config.json: not a usable model config: {err}") from err


def captured_cut(text: PretrainedConfig, layer_ids: list[int] | None, num_features: int) -> PretrainedConfig:
    """The text config the producer runs: cut after the last captured layer."""
    ids = list(layer_ids) if layer_ids else dflash_layer_ids(text.num_hidden_layers, num_features)
    cut = copy.deepcopy(text)
    set_layer_count(cut, max(ids) + 1)  # as load_target cuts it
    return cut


def rank_shard(text: PretrainedConfig, tp: int, ep: int) -> PretrainedConfig:
    """The shapes one rank of a TP (and EP) group holds: heads and MLP widths / tp, experts / ep."""
    shard = copy.deepcopy(text)
    if tp > 1:
        keys = TP_SPLIT_KEYS + (() if ep > 1 else ("moe_intermediate_size",))
        if ep > 1 and getattr(shard, "moe_intermediate_size", None) is None:
            keys = tuple(k for k in keys if k != "intermediate_size")  # gpt-oss: the experts' own width, kept whole
        for key in keys:
            value = getattr(shard, key, None)
            if isinstance(value, int) and value >= tp:
                setattr(shard, key, value // tp)
    if ep > 1:  # read once: some configs alias two of these names (gpt-oss: num_experts = num_local_experts)
        counts = {key: v for key in EXPERT_COUNT_KEYS if isinstance(v := getattr(text, key, None), int)}
        for key, value in counts.items():
            setattr(shard, key, value // ep)
            shard.num_experts_per_tok = min(getattr(shard, "num_experts_per_tok", 1), value // ep)
    return shard


def prefix_of_every_kind(text: PretrainedConfig) -> PretrainedConfig:
    """The shortest leading stack that holds every layer kind of the cut model (its forward's per-layer peak is
    the whole model's: inference frees each layer's activations before the next). A kind is the layer's type
    (full, sliding or linear attention) and the classes of its modules: DeepSeek-V3's and GLM-4.5's first
    layers have a dense MLP and the rest experts, under one layer type."""
    kinds = layer_kinds(text)
    need = set(kinds)
    n = next(i + 1 for i in range(len(kinds)) if set(kinds[: i + 1]) == need)
    small = copy.deepcopy(text)
    set_layer_count(small, n)
    return small


def layer_kinds(text: PretrainedConfig) -> list[tuple[str, tuple[str, ...]]]:
    """Each decoder layer's (layer type, sorted module class names), from the model built on the meta device."""
    with torch.device("meta"):
        model = AutoModel.from_config(text)
    types = list(getattr(text, "layer_types", None) or [])
    return [
        (types[i] if i < len(types) else "", tuple(sorted({type(m).__name__ for m in layer.modules()})))
        for i, layer in enumerate(model.layers)
    ]


def weight_bytes(text: PretrainedConfig, dtype: str, final_norm: bool = True) -> int:
    """Parameters and buffers of the decoder `text` describes, built on the meta device (no memory); without
    its final `norm` where the producer drops it (a cut decoder: the norm only feeds the LM head)."""
    with torch.device("meta"):
        model = AutoModel.from_config(text, dtype=DTYPES[dtype])
    if not final_norm and hasattr(model, "norm"):
        model.norm = torch.nn.Identity()
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def forward_peak(text: PretrainedConfig, dtype: str, tokens: int) -> int:
    """Peak bytes above the weights of one packed forward of `tokens` tokens (fake tensors, MemTracker)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    options = {"dtype": DTYPES[dtype], "attn_implementation": "sdpa"}
    if any(isinstance(getattr(text, k, None), int) for k in EXPERT_COUNT_KEYS):
        options["experts_implementation"] = "grouped_mm"  # static shapes: the eager loop over hit experts is not
    try:  # flash-style attention, no [T, T] scores (flex on CUDA is the same); eager where sdpa is not supported
        with torch.device("meta"):
            AutoModel.from_config(text, **options)
    except ValueError:
        options["attn_implementation"] = "eager"

    def at(t: int) -> int:
        with FakeTensorMode():
            model = AutoModel.from_config(text, **options).requires_grad_(False).eval()  # frozen, as load_target
            ids, pos = torch.zeros(1, t, dtype=torch.long), torch.arange(t)[None]

            def run():
                with torch.inference_mode():  # as TargetCapture.forward
                    model(input_ids=ids, position_ids=pos, use_cache=False)

            weights = sum(x.untyped_storage().nbytes() for x in [*model.parameters(), *model.buffers()])
            return frozen_peak(run, [model]) - weights

    if tokens <= FIT_TOKENS[1]:
        return at(tokens)
    (t1, t2), (p1, p2) = FIT_TOKENS, (at(FIT_TOKENS[0]), at(FIT_TOKENS[1]))
    return int(p2 + (p2 - p1) * (tokens - t2) / (t2 - t1))


def plan_target(job: JobConfig, text: PretrainedConfig) -> list[ProcessMemory]:
    """One entry per target rank on a CUDA device (CPU ranks are not GPU memory)."""
    t = job.target
    cut = captured_cut(text, t.layer_ids, t.num_features)
    shard = rank_shard(cut, t.tp_size, t.ep_size)
    weights = weight_bytes(shard, t.dtype, final_norm=cut.num_hidden_layers == text.num_hidden_layers)
    acts = forward_peak(prefix_of_every_kind(shard), t.dtype, job.data.tokens_per_batch)
    width = (len(t.layer_ids) if t.layer_ids else t.num_features) * int(text.hidden_size)
    ring = job.transport.slots * (
        job.transport.slot_bytes or required_slot_bytes(job.data.tokens_per_batch, width, job.slot_feature_dtype)
    )
    out = []
    for replica in range(t.replicas):
        for rank, dev in enumerate(t.devices_of(replica)):
            if not dev.startswith("cuda"):
                continue
            parts = {"weights": weights, "forward": acts}
            if rank == 0 and job.transport_kind == "cuda":
                parts["ring"] = ring
            if rank == 0 and job.transport.features == "fp8":  # the forward's output before quantisation
                parts["fp8_staging"] = job.data.tokens_per_batch * width * ITEM_BYTES[t.dtype] + 2 * CHUNK * 4
            parts["cuda_context"] = CUDA_CONTEXT_BYTES
            out.append(ProcessMemory(producer_name(replica, rank), dev, parts))
    return out


DESCRIPTION = "the target ranks' planned GPU memory (common/memory_plan.py), one JSON line per rank with --json"


def read_config(job: JobConfig, path: str) -> PretrainedConfig:
    """The plan commands' input reader (common/role_plans.py): the target's text config."""
    return read_text_config(path)


def main(argv: list[str]) -> int:
    """`python -m producer memory-plan JOB [--target-config DIR] [--json]`: one line per target rank."""
    return plan_command("producer", "memory-plan", argv, DESCRIPTION, read_config, memory=plan_target)
