"""The published DFlash1 layout (dflash.md §3, z-lab's drafters): what an export directory holds.

    config.json         the drafter config SGLang / vLLM / transformers read (`export_config`)
    model.safetensors   trained weights only (no embedding, no lm_head), in the export dtype
    dflash.py           the modeling file for AutoModel + trust_remote_code (consumer/export/dflash.py)

A checkpoint (consumer/checkpoint.py) is an export directory plus the training state; this module knows
the format, checkpoint.py the life cycle (atomic write, manifest, pointers, fallback).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from consumer.dflash2 import DFlash2Drafter
from consumer.dspark import DSparkDrafter, dspark_export_config
from consumer.mask_token import mask_token_text
from consumer.model import DrafterArch
from consumer.shape import shape_from_config
from consumer.sliding_rule import export_keys as sliding_export_keys
from consumer.target_parts import TargetParts

EXPORT_MODULE = Path(__file__).parent / "dflash.py"
EXPORT_FILES = ("config.json", "model.safetensors", "dflash.py")


def export_config(
    arch: DrafterArch,
    parts: TargetParts,
    *,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int],
    dtype: str,
) -> dict:
    """config.json of the published format ([SF] configs/qwen3-8b-dflash.json, z-lab's drafters).

    RoPE and the per-layer attention kinds are the drafter's own (rope_theta/rope_scaling for SGLang and
    vLLM, rope_parameters for transformers 5); max_window_layers counts the leading full-attention
    layers (Qwen2's convention; layer_types is authoritative); is_causal false says every layer is
    non-causal, sliding ones included, unless the sliding layers' block is causal (then `is_causal` is left
    out: consumer/sliding_rule.py); the MASK token as its id and its string (SGLang reads both); bos/eos
    are the target's; max_position_embeddings is the target's, or a yarn drafter's original × factor
    (DrafterArch.rope_positions)."""
    kinds = list(arch.attention_layers)
    sliding = "sliding_attention" in kinds
    scaling = {k: v for k, v in arch.rope_parameters.items() if k != "rope_theta"} if arch.rope_scaling else None
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "mask_token": mask_token_text(str(parts.path), mask_token_id),
            "target_layer_ids": list(target_layer_ids),
            "block_size": block_size,  # the trained block, also where z-lab's and SGLang's readers look first
        },
        "num_target_layers": parts.num_hidden_layers,
        "num_hidden_layers": arch.num_layers,
        "layer_types": kinds,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": arch.rope_parameters,
        "max_position_embeddings": arch.rope_positions if arch.rope_scaling else parts.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        **sliding_export_keys(arch.sliding_block_attention, kinds),
        "initializer_range": 0.02,
        "use_sliding_window": sliding,
        "sliding_window": arch.sliding_window,
        "max_window_layers": kinds.index("sliding_attention") if sliding else arch.num_layers,
        "tie_word_embeddings": False,
        "vocab_size": parts.vocab_size,
        **target_special_tokens(parts.path),
        "use_cache": True,
        "dtype": dtype,
    }


def trainer_export_config(trainer) -> dict:
    """export_config of a Trainer's drafter (its arch, target parts, block size, mask token, layers, dtype),
    in the DFlash2 layout for a DFlash2 drafter."""
    return export_config_of(
        export_config(
            trainer.arch,
            trainer.parts,
            block_size=trainer.cfg.block_size,
            mask_token_id=trainer.mask_token_id,
            target_layer_ids=trainer.target_layer_ids,
            dtype=trainer.cfg.dtype,
        ),
        trainer.model,
    )


def target_special_tokens(path: Path) -> dict:
    """bos_token_id / eos_token_id of the target: its generation config's (the stop list generate() uses,
    e.g. Llama 3's three end tokens), else its (text) config's; eos may be a list. Missing ones are left out."""
    found: dict = {}
    for name in ("config.json", "generation_config.json"):  # the later file wins
        file = Path(path) / name
        if not file.is_file():
            continue
        cfg = json.loads(file.read_text())
        for scope in (cfg, cfg.get("text_config") or {}):
            found.update({k: scope[k] for k in ("bos_token_id", "eos_token_id") if scope.get(k) is not None})
    return found


def write_export(out_dir: Path, model_state: dict[str, torch.Tensor], config: dict) -> None:
    """config.json + model.safetensors (cast to config['dtype']) + dflash.py into out_dir (which exists).
    Not fsynced: a checkpoint makes them durable (consumer/checkpoint.py), a plain export need not."""
    dtype = getattr(torch, config["dtype"])
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model_state.items()}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(EXPORT_MODULE, out_dir / "dflash.py")
    for name, source in extra_export_files(config).items():  # DFlash2: dflash2.py, which imports dflash.py
        shutil.copyfile(source, out_dir / name)


def drafter_shape(trainer) -> dict:
    """The shape keys of `trainer` (consumer/shape.py), as a checkpoint records them in trainer_state.pt:
    those its export config carries, and the optimizer's class."""
    return {**shape_from_config(trainer_export_config(trainer)), "optimizer": type(trainer.optimizer).__name__}


# ------------------------------------------------------------------------------------------ DFlash2
# The layout SGLang and vLLM load (recipes.md §5): vLLM vllm/model_executor/models/qwen3_dflash2.py indexes
# dflash_config["conv_kernel_size"], ["conv_group_size"], ["selector_rank"], ["selector_top_k"] directly and
# allocates `candidate_selector.{predecessor,successor}_codebook` as bare [V, r] parameters and
# `layers.{i}.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}`; "DFlashDraftModel" would silently
# serve DFlash1. consumer/export/dflash2.py (shipped with dflash.py, which it imports) serves it in transformers.
DFLASH2_MODELING_FILE = Path(__file__).parent / "dflash2.py"


def export_config_of(config: dict, model: nn.Module) -> dict:
    """export_config's dict, made the DFlash2 layout when `model` is a DFlash2Drafter, the DSpark one
    (consumer/dspark.py: Qwen3DSparkModel) for a DSparkDrafter."""
    if isinstance(model, DSparkDrafter):
        return dspark_export_config(config, model.shape)
    if not isinstance(model, DFlash2Drafter):
        return config
    s = model.shape
    return {
        **config,
        "architectures": ["DFlash2DraftModel"],
        "auto_map": {"AutoModel": "dflash2.DFlash2DraftModel"},
        "dflash_config": {
            **config["dflash_config"],
            "block_size": s.block_size,
            "conv_kernel_size": s.conv_kernel_size,
            "conv_group_size": s.conv_group_size,
            "selector_rank": s.selector_rank,
            "selector_top_k": s.selector_top_k,
            **s.export_keys(),  # output_multiplier, final_logit_softcapping, selector_vocab_size when they apply
        },
    }


def extra_export_files(config: dict) -> dict[str, Path]:
    """Modeling files an export of `config` ships besides dflash.py: {name in the export: source}."""
    return {"dflash2.py": DFLASH2_MODELING_FILE} if config.get("architectures") == ["DFlash2DraftModel"] else {}
