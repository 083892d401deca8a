"""Checks of a job against its target's config.json on disk, run when the job file loads (before anything loads
the target): the slot size against the largest batch, tensor and expert parallelism against the model's shape.

Each check returns "key: reason" or None; `parse_job` (common/config.py) names the file and raises. A target
not on disk yet (or a config.json the producer will name as broken when it loads it) passes: the producer
checks again with the model in hand. Only the expert-parallel check imports transformers, and only then.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from common.packed_batch import required_slot_bytes


class _Target(Protocol):
    path: str
    dtype: str
    tp_size: int
    ep_size: int
    layer_ids: Sequence[int] | None
    num_features: int


class _Drafter(Protocol):
    arch: str
    conv_group_size: int


class _Data(Protocol):
    tokens_per_batch: int


class _Transport(Protocol):
    slot_bytes: int


class JobView(Protocol):
    """What the checks read of a job (common/config.py's job model has it)."""

    target: _Target
    drafters: Sequence[_Drafter]
    data: _Data
    transport: _Transport

    @property
    def slot_feature_dtype(self) -> str: ...


EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def target_problem(job: JobView) -> str | None:
    """The first way `job` does not fit its target ("key: reason"), or None."""
    return (
        slot_capacity_problem(job)
        or tensor_parallel_problem(job)
        or expert_parallel_problem(job)
        or dflash2_group_problem(job)
    )


def target_files_problem(job: JobView) -> str | None:
    """Before a launch starts any process: the target must be a folder with a readable config.json (a hub id is
    its snapshot folder by now: `load_job` resolved it). The producer loads the rest; this finds a wrong path in
    a second instead of after telemetry, producer and consumers started."""
    path = Path(job.target.path)
    if not path.exists():
        return f"target.path: {str(path)!r} does not exist (a local model folder, or a hub id owner/name)"
    if not path.is_dir():
        return f"target.path: {str(path)!r} is not a folder (a model folder holds config.json and the weights)"
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        return f"target.path: {str(path)!r} has no config.json: not a Hugging Face model folder"
    try:
        cfg = json.loads(cfg_path.read_text())
    except OSError as err:
        return f"target.path: cannot read {cfg_path}: {err.strerror}"
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        return f"target.path: {cfg_path} is not valid JSON: {err}"
    if not isinstance(cfg, dict):
        return f"target.path: {cfg_path} holds a JSON {type(cfg).__name__}, not an object"
    return None


def dflash2_group_problem(job: JobView) -> str | None:
    """A DFlash2 drafter's conv_group_size must divide the target's hidden size (checked when its config is on disk)."""
    cfg_path = Path(job.target.path) / "config.json"
    if not any(d.arch == "dflash2" for d in job.drafters) or not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
        hidden = int(cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size") or 0)
    except (ValueError, OSError, AttributeError):
        return None
    for i, d in enumerate(job.drafters):
        if d.arch == "dflash2" and hidden and hidden % d.conv_group_size:
            return (
                f"drafters.{i}.conv_group_size: {d.conv_group_size} does not divide the target's hidden_size"
                f" {hidden} ({cfg_path}); choose a divisor (DFlash2's default 16)"
            )
    return None


def tensor_parallel_problem(job: JobView) -> str | None:
    """transformers' TP plans split attention by heads (and KV heads) and MLPs by columns (a MoE target's
    experts and shared expert too, unless expert parallelism holds the experts whole): tp_size must divide
    them. Checked when the target's config is on disk (a multimodal wrapper's numbers are in text_config)."""
    tp = job.target.tp_size
    cfg_path = Path(job.target.path) / "config.json"
    if tp == 1 or not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (ValueError, OSError):
        return None  # the producer names a broken config.json when it loads the target
    text = cfg.get("text_config") or cfg
    keys = ["num_attention_heads", "num_key_value_heads", "intermediate_size", "shared_expert_intermediate_size"]
    if job.target.ep_size == 1:  # without EP, TP slices every expert's MLP too; with EP each rank holds whole ones
        keys.append("moe_intermediate_size")
    for key in keys:
        value = text.get(key)
        if isinstance(value, int) and value % tp:
            return (
                f"target.tp_size: tp_size = {tp} does not divide the target's {key}"
                f" ({value}, {cfg_path}): tensor parallelism splits it evenly across the ranks"
            )
    return None


def expert_parallel_problem(job: JobView) -> str | None:
    """ep_size > 1 needs a MoE target whose transformers config has an expert-parallel plan
    (`base_model_ep_plan`: qwen3_moe, qwen3_5_moe, gpt_oss, deepseek_v3, glm4_moe, ...) and an expert count that
    ep_size divides: each rank holds num_experts / ep_size whole experts. Checked when the target's config is on
    disk (transformers is imported only then)."""
    ep = job.target.ep_size
    cfg_path = Path(job.target.path) / "config.json"
    if ep == 1 or not cfg_path.is_file():
        return None
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(job.target.path, local_files_only=True).get_text_config()
    except (OSError, ValueError, KeyError):
        return None  # the producer names a config.json transformers cannot read when it loads the target
    where = f"{type(text).__name__}, {cfg_path}"
    if not getattr(text, "base_model_ep_plan", None):
        return (
            f"target.ep_size: ep_size = {ep} but the target ({where}) has no expert-parallel"
            " plan in transformers (base_model_ep_plan): expert parallelism needs a MoE target such as"
            " qwen3_moe, qwen3_5_moe, gpt_oss, deepseek_v3 or glm4_moe; set ep_size = 1"
        )
    experts = next((v for k in EXPERT_COUNT_KEYS if isinstance(v := getattr(text, k, None), int)), None)
    if experts is not None and experts % ep:
        return (
            f"target.ep_size: ep_size = {ep} does not divide the target's {experts} experts"
            f" ({where}): each rank holds an equal share of whole experts"
        )
    return None


def slot_capacity_problem(job: JobView) -> str | None:
    """A fixed slot_bytes must hold the largest batch; known only when the target's config is on disk."""
    if job.transport.slot_bytes == 0:
        return None
    width = target_feature_width(job)
    if width is None:
        return None
    need = required_slot_bytes(job.data.tokens_per_batch, width, job.slot_feature_dtype)
    if job.transport.slot_bytes < need:
        return (
            f"transport.slot_bytes: {job.transport.slot_bytes} bytes is smaller than the largest"
            f" batch ({need} bytes for data.tokens_per_batch={job.data.tokens_per_batch} tokens ×"
            f" {width} features in {job.slot_feature_dtype}); raise it or set 0 to size it automatically"
        )
    return None


def target_feature_width(job: JobView) -> int | None:
    """n·H, read from the target's config.json when it exists."""
    cfg_path = Path(job.target.path) / "config.json"
    if not cfg_path.is_file():
        return None
    try:
        hidden = int(json.loads(cfg_path.read_text()).get("hidden_size", 0))
    except (ValueError, OSError):
        return None
    n = len(job.target.layer_ids) if job.target.layer_ids else job.target.num_features
    return n * hidden if hidden else None
