"""Which stored tensor of a target checkpoint is which model parameter, shared by the producer (which loads the
text decoder alone) and the consumers (which read the embedding and LM head).

Checkpoints store their tensors under the names of the class they were saved from: a multimodal wrapper such as
`Gemma3ForConditionalGeneration` or `Mistral3ForConditionalGeneration` writes its text decoder under
`language_model.model.*`, `Qwen3_5ForConditionalGeneration` under `model.language_model.*`. transformers maps
those names with the conversion mapping of that class (`get_model_conversion_mapping`), not of the text decoder,
so the names are mapped here through the checkpoint's own class (`config.architectures`), built on the meta
device with one decoder layer (no memory, no weights read).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

from common.weight_files import WeightFileError, safetensors_files


class TargetFolderError(ValueError):
    """The target's model folder or its config.json is missing or unreadable; the message names the path."""


def read_target_config(path: Path) -> PretrainedConfig:
    """The config of the model folder `path` (the checkpoint's class config: a wrapper's, not its text config),
    with one line naming what is wrong when there is no usable one."""
    if not path.is_dir():
        what = "is a file, not a model directory" if path.exists() else "target model directory does not exist"
        raise TargetFolderError(f"{path}: {what}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise TargetFolderError(f"{path}: no config.json in the target model directory (a Hugging Face model folder)")
    try:
        json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TargetFolderError(f"{cfg_file}: not valid JSON: {err}") from None
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise TargetFolderError(f"{cfg_file}: not a usable model config: {err}") from None


def set_layer_count(config: PretrainedConfig, keep: int) -> None:
    """Cut `config` (a text config) to `keep` decoder layers: `num_hidden_layers` and a stored `layer_types`
    list. A read-only layer-kind property (jamba's `layer_types`, falcon_h1's `layers_block_type`, mamba's) is
    derived from the count and left alone."""
    config.num_hidden_layers = keep
    name = getattr(config, "attribute_map", {}).get("layer_types", "layer_types")
    prop = getattr(type(config), name, None)
    if isinstance(prop, property) and prop.fset is None:
        return
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:keep]


def checkpoint_class(config: PretrainedConfig) -> type[nn.Module] | None:
    """The transformers class the checkpoint was saved from (`config.architectures[0]`), if transformers has it."""
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    return cls if isinstance(cls, type) and issubclass(cls, nn.Module) else None


def meta_model(cls: type[nn.Module], config: PretrainedConfig) -> nn.Module:
    """`cls` built from `config` with a one-layer text decoder on the meta device (parameter names only)."""
    small = copy.deepcopy(config)
    set_layer_count(small.get_text_config(), 1)
    with torch.device("meta"):
        return cls(small)


def stored_keys(path: Path) -> dict[str, Path]:
    """Every tensor key in the safetensors file(s) of the model directory `path` → the file holding it."""
    by_key: dict[str, Path] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                by_key.update(dict.fromkeys(f.keys(), file))
        except (SafetensorError, OSError) as err:
            raise WeightFileError(f"{file}: not a readable safetensors file: {err}") from None
    return by_key


def parameter_names(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """Each stored key → the parameter name `model` loads it as, through the library's conversion mapping for
    `model` (renamings, then at most one converter's target), as from_pretrained renames them."""
    mapping = get_model_conversion_mapping(model, None, None)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    params = dict(model.named_parameters(remove_duplicate=False))
    return {key: rename_source_key(key, renamings, converters, model.base_model_prefix, params)[0] for key in keys}


def submodule_name(model: nn.Module, module_cls: type) -> str | None:
    """The name of `model`'s outermost submodule of class `module_cls` ("" for the model itself)."""
    return next((name for name, m in model.named_modules() if isinstance(m, module_cls)), None)


def decoder_key_mapping(path: Path, config: PretrainedConfig, decoder_cls: type[nn.Module]) -> dict[str, str] | None:
    """The `key_mapping` that lets `decoder_cls.from_pretrained(path)` find a text decoder stored inside a
    multimodal wrapper: {'^<stored prefix>': ''}, the prefix read off the embedding's stored key as the
    checkpoint's class maps it. None when the decoder's own mapping already finds the embedding (causal LMs, the
    Qwen3.5 wrapper), or when the weights are not safetensors or no wrapper class is known (from_pretrained
    then reports what it misses)."""
    try:
        keys = list(stored_keys(path))
    except WeightFileError:
        return None
    if not keys:
        return None
    decoder = meta_model(decoder_cls, config.get_text_config())
    embed = _embedding_name(decoder)
    if embed in parameter_names(decoder, keys).values():
        return None
    wrapper_cls = checkpoint_class(config)
    if wrapper_cls is None:
        return None
    wrapper = meta_model(wrapper_cls, config)
    inner = submodule_name(wrapper, decoder_cls)
    if not inner:
        return None
    want = f"{inner}.{embed}"
    stored = next((k for k, name in parameter_names(wrapper, keys).items() if name == want), None)
    if stored is None or not stored.endswith(embed):
        return None
    return {"^" + re.escape(stored[: -len(embed)]): ""}


def _embedding_name(model: nn.Module) -> str:
    emb = model.get_input_embeddings()
    return next(f"{name}.weight" for name, m in model.named_modules() if m is emb)
