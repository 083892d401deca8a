"""The few pieces of the frozen target a drafter needs, read without loading the target.

A drafter borrows the target's per-layer dims and two frozen matrices: the token embedding (block inputs) and
the LM head (drafter logits). The dims come from the TEXT config (`config.get_text_config()`: a multimodal
wrapper such as Qwen3.6-27B's `Qwen3_5ForConditionalGeneration` keeps them under `text_config`). The two
tensors are found through the model's own structure, not a table of key names: transformers' causal-LM class
for that text config is built on the meta device (no memory), `get_input_embeddings()` /
`get_output_embeddings()` name the parameters, and the library's checkpoint key mapping (e.g.
`model.language_model.embed_tokens.weight` → `model.embed_tokens.weight`) says which stored tensor becomes
which. A tied LM head is the embedding itself. Both are read from the safetensors file(s) tensor by tensor, so
a 27B target costs two [V, H] reads, never the vision tower or the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from common.target_keys import (
    TargetFolderError,
    checkpoint_class,
    meta_model,
    parameter_names,
    read_target_config,
    stored_keys,
)
from common.weight_files import WeightFileError, check_weight_files


class TargetPartsError(RuntimeError):
    """The target directory cannot give the drafter its parts; the message names the file and the problem."""


@dataclass(frozen=True)
class TargetParts:
    path: Path
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP width; MoE targets: moe_intermediate_size × experts per token
    rms_norm_eps: float
    vocab_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    embed_tokens: torch.Tensor  # [V, H], frozen
    lm_head: torch.Tensor  # [V, H], frozen (the embedding itself when tied)


def load_target_parts(path: str | Path, dtype: torch.dtype | None = None) -> TargetParts:
    """Text-config dims + frozen embedding and LM head of the target at `path` (cast to `dtype` if given)."""
    path = Path(path)
    config = _read_config(path)
    text = config.get_text_config()
    model = _meta_model(config, text, path)  # first: an unsupported architecture is named as such
    fields = _dims(text, path / "config.json")
    embed_name = _param_name(model, model.get_input_embeddings(), "input embedding")
    head = model.get_output_embeddings()
    if head is None:
        raise TargetPartsError(f"{path}: {type(model).__name__} has no output embedding (LM head)")
    tied = head.weight is model.get_input_embeddings().weight
    stored = _stored_keys(path, model)  # model parameter name -> (file, checkpoint key)
    embed = _read_tensor(stored, embed_name, path)
    lm_head = embed if tied else _read_tensor(stored, _param_name(model, head, "LM head"), path)
    hidden, vocab = fields["hidden_size"], fields["vocab_size"]
    for what, t in (("embedding", embed), ("LM head", lm_head)):
        if tuple(t.shape) != (vocab, hidden):
            raise TargetPartsError(
                f"{path}: the {what} has shape {tuple(t.shape)}, expected [vocab_size, hidden_size] = [{vocab}, {hidden}]"
            )
    if dtype is not None:
        embed = embed.to(dtype)
        lm_head = embed if tied else lm_head.to(dtype)
    return TargetParts(path=path, tie_word_embeddings=tied, embed_tokens=embed, lm_head=lm_head, **fields)


def _read_config(path: Path) -> PretrainedConfig:
    try:
        return read_target_config(path)
    except TargetFolderError as err:
        raise TargetPartsError(str(err)) from None


def _dims(text: PretrainedConfig, cfg_file: Path) -> dict:
    def need(name: str):
        value = getattr(text, name, None)
        if value is None:
            raise TargetPartsError(f"{cfg_file}: {type(text).__name__} has no {name}; the drafter needs it")
        return value

    hidden = int(need("hidden_size"))
    attention = getattr(text, "num_attention_heads", None)
    # a pure state-space target (mamba) has no attention heads (a mamba2 `head_dim` is its SSM's): the drafter's
    # attention gets heads 128 wide, or one head when narrower
    heads = int(attention or max(1, hidden // 128))
    head_dim = int((getattr(text, "head_dim", None) if attention else None) or hidden // heads)
    width = getattr(text, "intermediate_size", None)
    if width is None and getattr(text, "moe_intermediate_size", None):  # MoE-only targets (Qwen3.5-MoE)
        width = int(text.moe_intermediate_size) * int(getattr(text, "num_experts_per_tok", 1))
    if width is None:
        raise TargetPartsError(f"{cfg_file}: {type(text).__name__} has no intermediate_size (nor a MoE width)")
    return dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        intermediate_size=int(width),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", None) or 1e-6),
        vocab_size=int(need("vocab_size")),
        num_hidden_layers=int(need("num_hidden_layers")),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 32768),
    )


def _meta_model(config: PretrainedConfig, text: PretrainedConfig, path: Path) -> nn.Module:
    """The class the checkpoint was saved from, when it is generative (an LM head: a causal LM, a multimodal
    wrapper such as Gemma3ForConditionalGeneration or Qwen3VLForConditionalGeneration), else transformers'
    causal-LM class for the text config; one layer deep, on the meta device (names only). Its own conversion
    mapping is the one that names the stored keys."""
    cls = checkpoint_class(config)
    if cls is not None:
        model = meta_model(cls, config)
        if model.get_output_embeddings() is not None:
            return model
    if type(text) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        arch = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        raise TargetPartsError(
            f"{path}: unsupported target architecture {arch}: transformers has no causal-LM class for its text"
            f" config {type(text).__name__} (model_type {text.model_type!r}), which names the embedding and LM head"
        )
    return meta_model(MODEL_FOR_CAUSAL_LM_MAPPING[type(text)], text)


def _param_name(model: nn.Module, module: nn.Module, what: str) -> str:
    for name, m in model.named_modules():
        if m is module:
            return f"{name}.weight"
    raise TargetPartsError(f"{type(model).__name__}: its {what} is not one of its modules")


def _stored_keys(path: Path, model: nn.Module) -> dict[str, tuple[Path, str]]:
    """Each model parameter name → (safetensors file, checkpoint key), through the library's key mapping."""
    try:
        check_weight_files(path)
        by_key = stored_keys(path)
    except WeightFileError as err:
        raise TargetPartsError(str(err)) from None
    if not by_key:
        raise TargetPartsError(
            f"{path}: neither model.safetensors nor model.safetensors.index.json exists in the target directory"
        )
    stored: dict[str, tuple[Path, str]] = {}
    for key, name in parameter_names(model, list(by_key)).items():
        stored.setdefault(name, (by_key[key], key))
    return stored


def _read_tensor(stored: dict[str, tuple[Path, str]], name: str, path: Path) -> torch.Tensor:
    if name not in stored:
        raise TargetPartsError(f"{path}: no stored tensor maps to {name!r} in its safetensors file(s)")
    file, key = stored[name]
    if not file.is_file():
        raise TargetPartsError(f"{file}: listed in the safetensors index for {key!r} but missing")
    try:
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(key)
    except (SafetensorError, OSError) as err:
        raise TargetPartsError(f"{file}: cannot read tensor {key!r} (truncated or corrupt file?): {err}") from None
