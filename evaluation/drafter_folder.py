"""What dflash-eval reads from a drafter folder, checked before any model is built: one line per fault.

A damaged or mismatched folder (a missing, renamed, extra or misshapen tensor, a layer count the weights
disagree with, a truncated model.safetensors, a MASK id outside the target's vocabulary, non-float weights)
raises DrafterFolderError naming the file, the tensor or key, what was expected and what was found; the CLI
prints it and exits 2 instead of a torch traceback.

Other trainers' folders (docs/evaluation.md, "Drafters from other trainers"):
  - z-lab's published drafters and SpecForge's `save_pretrained` folders are the layout this project writes
    (config.json with architectures DFlashDraftModel and dflash_config; unprefixed tensor names, no embedding,
    no lm_head): read as they are.
  - vLLM speculators' DFlash folders (`speculators_model_type: "dflash"`: the drafter's dims under
    transformer_layer_config, `aux_hidden_state_layer_ids`, `mask_token_id`, `block_size`) are translated as
    vLLM's speculators config loader does (target_layer_ids = aux ids - 1) when they draft over the target's
    full vocabulary; a reduced draft vocabulary (lm_head + d2t), the Domino projector or sample_from_anchor
    are refused, naming the key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.weight_files import WeightFileError, check_safetensors_file, safetensors_files

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # cast to the evaluation dtype
EMBEDDING_KEYS = ("embed_tokens.weight", "lm_head.weight")  # the target's, never the drafter's
VOCAB_MAPS = ("d2t", "t2d")  # speculators' draft/target vocabulary maps: identity for a full-vocabulary drafter
LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


class DrafterFolderError(ValueError):
    """A drafter folder that cannot be evaluated; the message names the file, key, expected and found."""


def _shape(shape) -> str:
    return "[" + ", ".join(str(int(n)) for n in shape) + "]"


def read_config(path: Path) -> dict:
    """config.json of the drafter folder `path`, in this project's (z-lab's) layout: another trainer's
    layout is translated, or refused naming the key that makes it unusable here."""
    file = path / "config.json"
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DrafterFolderError(f"{file}: not a readable JSON config ({err})") from None
    if not isinstance(cfg, dict):
        raise DrafterFolderError(f"{file}: expected a JSON object, found {type(cfg).__name__}")
    kind = cfg.get("speculators_model_type")
    if kind is None:
        return cfg
    if kind != "dflash":
        raise DrafterFolderError(
            f"{file}: speculators_model_type {kind!r}: only speculators' 'dflash' drafters evaluate here"
            " (an EAGLE-3, MTP or other speculator drafts with another model)"
        )
    return _from_speculators(cfg, file)


def _from_speculators(cfg: dict, file: Path) -> dict:
    """A speculators DFlash config.json, as vLLM's speculators loader (update_dflash) turns it into the
    DFlashDraftModel layout: the transformer_layer_config's dims at the top, dflash_config from
    mask_token_id and aux_hidden_state_layer_ids (minus one: speculators count the embedding output as 0)."""
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DrafterFolderError(f"{file}: speculators config without transformer_layer_config (the drafter's dims)")
    for key in ("aux_hidden_state_layer_ids", "mask_token_id"):
        if cfg.get(key) is None:
            raise DrafterFolderError(f"{file}: speculators DFlash config: required key {key!r} is missing or null")
    vocab = layer.get("vocab_size")
    if cfg.get("draft_vocab_size") not in (None, vocab):
        raise DrafterFolderError(
            f"{file}: draft_vocab_size {cfg['draft_vocab_size']} differs from transformer_layer_config.vocab_size"
            f" {vocab}: a reduced draft vocabulary (its own lm_head and d2t map) is not evaluated here; expected"
            " a drafter over the target's full vocabulary"
        )
    for key, allowed in (("projector_type", "dflash"), ("sample_from_anchor", False)):
        if cfg.get(key, allowed) != allowed:
            raise DrafterFolderError(
                f"{file}: {key} is {cfg[key]!r}; only {allowed!r} (plain DFlash drafting) evaluates here"
            )
    kinds = layer.get("layer_types") or []
    out = {
        **layer,
        "architectures": ["DFlashDraftModel"],
        "block_size": int(cfg.get("block_size", 8)),
        "dflash_config": {
            "mask_token_id": int(cfg["mask_token_id"]),
            "target_layer_ids": [int(i) - 1 for i in cfg["aux_hidden_state_layer_ids"]],
        },
    }
    if "sliding_attention" in kinds and cfg.get("sliding_window_non_causal"):
        out["is_causal"] = False  # every layer non-causal inside the block, sliding ones too
    return out


def load_weights(path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """Every tensor of the folder's safetensors files (model.safetensors, or the shards its index lists),
    each file checked whole first; non-float tensors are refused. Returns (tensors, the file to name)."""
    try:
        files = safetensors_files(path)
        if not files:
            raise DrafterFolderError(f"{path}: no model.safetensors (expected a DFlash export directory)")
        for file in files:
            check_safetensors_file(file)
    except WeightFileError as err:
        raise DrafterFolderError(str(err)) from None
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name in VOCAB_MAPS:
                continue
            if tensor.dtype not in FLOAT_DTYPES:
                raise DrafterFolderError(
                    f"{file}: tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}; expected float weights"
                    " (float32, bfloat16, float16): a quantized drafter is not evaluated here (casting its"
                    " integers, without their scales, would evaluate other weights); export it unquantized"
                )
            state[name] = tensor
    return state, files[0] if len(files) == 1 else path / "model.safetensors.index.json"


def check_mask_token(cfg: dict, vocab_size: int, file: Path, target: str | Path) -> None:
    """dflash_config.mask_token_id must be a token of the target's vocabulary (its embedding row)."""
    mask = cfg["dflash_config"]["mask_token_id"]
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < vocab_size:
        raise DrafterFolderError(
            f"{file}: dflash_config.mask_token_id is {mask!r}; expected a token id of the target {target}"
            f" (0..{vocab_size - 1})"
        )


def check_state(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], file: Path, cfg: dict) -> None:
    """The tensors of `file` against the model config.json describes: names, layer count, shapes."""
    extra = sorted(set(found) - set(expected))
    missing = sorted(set(expected) - set(found))
    if extra and missing:
        prefixes = {k[: k.index(".") + 1] for k in extra if "." in k}
        if len(prefixes) == 1 and {k[len(next(iter(prefixes))) :] for k in extra} >= set(missing):
            prefix = next(iter(prefixes))
            raise DrafterFolderError(
                f"{file}: tensor names carry the prefix {prefix!r} (e.g. {extra[0]!r}); expected the z-lab layout's"
                f" unprefixed names (e.g. {missing[0]!r})"
            )
    for key in EMBEDDING_KEYS:
        if key in extra:
            raise DrafterFolderError(
                f"{file}: holds {key!r} {_shape(found[key].shape)}; expected no {key.split('.')[0]} (the drafter"
                " uses the target's): remove it from the export"
            )
    layers_found = sorted({int(m.group(1)) for k in found if (m := LAYER_KEY.match(k))})
    layers_expected = sorted({int(m.group(1)) for k in expected if (m := LAYER_KEY.match(k))})
    if layers_found != layers_expected:
        held = f"layers {layers_found[0]}..{layers_found[-1]} ({len(layers_found)})" if layers_found else "no layers"
        raise DrafterFolderError(
            f"{file.parent / 'config.json'}: num_hidden_layers is {cfg.get('num_hidden_layers')}; {file.name} holds"
            f" {held}"
        )
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DrafterFolderError(
            f"{file}: tensor {missing[0]!r} is missing{more}; expected shape {_shape(expected[missing[0]].shape)}"
        )
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise DrafterFolderError(
            f"{file}: unexpected tensor {extra[0]!r} {_shape(found[extra[0]].shape)}{more}; expected only the"
            " DFlash drafter's (layers.*, fc, hidden_norm, norm)"
        )
    for key, tensor in expected.items():
        if found[key].shape != tensor.shape:
            raise DrafterFolderError(
                f"{file}: tensor {key!r} has shape {_shape(found[key].shape)}; expected {_shape(tensor.shape)}"
                f" from config.json{_why(key, cfg)}"
            )


def _why(key: str, cfg: dict) -> str:
    """The config.json keys a tensor's shape follows from (the common faults' hints)."""
    if key == "fc.weight":
        n = len(cfg["dflash_config"]["target_layer_ids"])
        return f" (hidden_size {cfg.get('hidden_size')} x {n} target_layer_ids)"
    return ""
