"""The few pieces of the frozen target a drafter needs, read without loading the target.

A drafter borrows the target's per-layer dims, its RoPE base, and two frozen matrices: the
token embedding (block inputs) and the lm_head (drafter logits). Both are read straight from
the safetensors file(s), tensor by tensor, so an 8B target costs two [V, H] reads, not 16 GB.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"


@dataclass(frozen=True)
class TargetParts:
    path: Path
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    embed_tokens: torch.Tensor  # [V, H], frozen
    lm_head: torch.Tensor  # [V, H], frozen (the embedding itself when tied)


def _read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"target directory {path}: no config.json (is this a Hugging Face model dir?)"
        )
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{cfg_file}: not valid JSON: {err}") from None


def _rope_theta(cfg: dict, cfg_file: Path) -> float:
    """transformers 5 keeps the base in rope_parameters; older configs in rope_theta + rope_scaling."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"{cfg_file}: rope type {rope_type!r} is not supported (the drafter uses default RoPE)"
        )
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{cfg_file}: neither rope_parameters.rope_theta nor rope_theta is set")
    return float(theta)


def _weight_files(path: Path) -> dict[str, Path]:
    """Map each wanted key to the safetensors file holding it."""
    single = path / "model.safetensors"
    if single.is_file():
        return {EMBED_KEY: single, LM_HEAD_KEY: single}
    index_file = path / "model.safetensors.index.json"
    if not index_file.is_file():
        raise FileNotFoundError(
            f"target directory {path}: neither model.safetensors nor model.safetensors.index.json exists"
        )
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as err:
        raise ValueError(f"{index_file}: not a safetensors index (missing weight_map?): {err}") from None
    return {key: path / name for key, name in weight_map.items() if key in (EMBED_KEY, LM_HEAD_KEY)}


def _read_tensor(files: dict[str, Path], key: str, path: Path) -> torch.Tensor:
    if key not in files:
        raise KeyError(f"target directory {path}: no tensor {key!r} in its safetensors file(s)")
    file = files[key]
    if not file.is_file():
        raise FileNotFoundError(f"{file}: listed in the safetensors index for {key!r} but missing")
    with safe_open(str(file), framework="pt") as f:
        if key not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
            raise KeyError(f"{file}: no tensor {key!r}")
        return f.get_tensor(key)


def load_target_parts(path: str | Path, dtype: torch.dtype | None = None) -> TargetParts:
    """Config fields + frozen embedding and lm_head of the target at `path` (cast to `dtype` if given)."""
    path = Path(path)
    cfg = _read_config(path)
    cfg_file = path / "config.json"
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        fields = dict(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            vocab_size=int(cfg["vocab_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except KeyError as err:
        raise KeyError(f"{cfg_file}: required field {err.args[0]!r} is missing") from None
    files = _weight_files(path)
    embed = _read_tensor(files, EMBED_KEY, path)
    lm_head = embed if fields["tie_word_embeddings"] else _read_tensor(files, LM_HEAD_KEY, path)
    for key, t in ((EMBED_KEY, embed), (LM_HEAD_KEY, lm_head)):
        if tuple(t.shape) != (fields["vocab_size"], hidden):
            raise ValueError(
                f"target directory {path}: {key} has shape {tuple(t.shape)},"
                f" expected [vocab_size, hidden_size] = [{fields['vocab_size']}, {hidden}]"
            )
    if dtype is not None:
        embed = embed.to(dtype)
        lm_head = embed if fields["tie_word_embeddings"] else lm_head.to(dtype)
    return TargetParts(
        path=path, rope_theta=_rope_theta(cfg, cfg_file), embed_tokens=embed, lm_head=lm_head, **fields
    )


def resolve_mask_token_id(path: str | Path, vocab_size: int, configured: int | None) -> int:
    """The drafter's MASK id: the configured one, else the tokenizer's mask token, else the last row."""
    if configured is None:
        configured = _tokenizer_mask_id(Path(path))
    mask_id = vocab_size - 1 if configured is None else configured
    if not 0 <= mask_id < vocab_size:
        raise ValueError(
            f"mask_token_id {mask_id} is outside the target's embedding matrix (vocab_size {vocab_size});"
            " the MASK embedding must be a row of the target's embedding"
        )
    return mask_id


def _tokenizer_mask_id(path: Path) -> int | None:
    if not (path / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return tok.mask_token_id
