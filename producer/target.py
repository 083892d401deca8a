"""The frozen target: load a local HF causal LM, truncated, as a TargetCapture (producer/capture.py: the packed
forward that captures the hidden states the drafter is conditioned on).

Any decoder-only causal LM transformers knows, including multimodal wrappers: the decoder is the base model
class of the checkpoint's TEXT config (`config.get_text_config()`, its base model from MODEL_MAPPING; the text
config has a causal-LM class, or the checkpoint's own class is a generative wrapper holding that decoder:
Qwen3-VL, Qwen2.5-VL), so a `Qwen3_5ForConditionalGeneration` checkpoint (Qwen3.6-27B) loads as
`Qwen3_5TextModel`. Stored names are mapped as the checkpoint's class maps them (common/target_keys.py: a
Gemma 3 or Mistral-Small-3 wrapper's `language_model.model.*` becomes a key_mapping for the decoder), and
from_pretrained materialises only the tensors the model has: never the vision tower, never the LM head. The
text config is cut to `max(layer_ids) + 1` layers before loading, so later layers are never read either; the
final norm is dropped (kept only when the last layer itself is captured, since HF's hidden_states[N] is normed).
Whatever the model's own code raises while loading (a hook, the leak probe's forward) becomes a TargetLoadError
naming the architecture: the entry points exit 2 with that one line.

Attention implementation ("auto"): on CUDA flex_attention where the model supports it (the packed mask becomes
a block mask: no dense [T, T] tensor), else sdpa; on the CPU "packed_sdpa" where the model supports sdpa
(producer/packed_attention.py: sdpa per packed sequence, Σ L² work, no [T, T] mask), else "packed_eager" (the
model's own eager attention per sequence: gpt-oss, whose attention sinks are implemented in eager and flex
only), else eager.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import AutoModel, PretrainedConfig
from transformers.distributed import DistributedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

from common.config import dflash_layer_ids
from common.target_keys import (
    TargetFolderError,
    checkpoint_class,
    decoder_key_mapping,
    meta_model,
    read_target_config,
    set_layer_count,
    stored_keys,
    submodule_name,
)
from common.weight_files import WeightFileError, check_weight_files
from producer import packed_attention
from producer.capture import TargetCapture

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (implementation, the model-class flag saying it is supported; eager always is)
ATTN_FLAGS = (
    ("flex_attention", "_supports_flex_attn"),
    (packed_attention.NAME, "_supports_sdpa"),  # sdpa per sequence
    ("sdpa", "_supports_sdpa"),
    (packed_attention.EAGER_NAME, None),  # the model's eager per sequence, where its module has one
    ("eager", None),
)
AUTO_ORDER = {
    "cuda": ("flex_attention", "sdpa", "eager"),
    "cpu": (packed_attention.NAME, packed_attention.EAGER_NAME, "eager"),
}
# generation (producer regenerate) pads its batches and grows a KV cache, packs nothing: sdpa where the model
# supports it, else its eager attention (gemma2's soft-capping, gpt-oss' sinks), on either device
GENERATE_ORDER = {"cuda": ("sdpa", "eager"), "cpu": ("sdpa", "eager")}

__all__ = ["DTYPES", "GENERATE_ORDER", "TargetCapture", "TargetLoadError", "choose_attn_implementation", "load_target"]


class TargetLoadError(RuntimeError):
    """The target directory cannot be used; the message names the path and what is missing."""


def choose_attn_implementation(
    model_cls: type, requested: str, device: str, order: dict[str, tuple[str, ...]] = AUTO_ORDER
) -> str:
    """The attention implementation to load `model_cls` with ("auto": the first of `order` for the device that
    the model supports; see the module docstring)."""
    supported = [impl for impl, flag in ATTN_FLAGS if flag is None or getattr(model_cls, flag, False)]
    if packed_attention.model_eager_attention(model_cls) is None:
        supported.remove(packed_attention.EAGER_NAME)
    if requested == "auto":
        return next(impl for impl in order["cuda" if device.startswith("cuda") else "cpu"] if impl in supported)
    if requested not in supported:
        raise TargetLoadError(
            f"{model_cls.__name__} does not support attn_implementation {requested!r}; it supports"
            f' {supported} (or set target.attn_implementation = "auto")'
        )
    return requested


def load_target(
    path: str | Path,
    layer_ids: list[int] | None = None,
    num_features: int = 5,
    dtype: str = "bfloat16",
    device: str = "cpu",
    attn_implementation: str = "auto",
    distributed_config: DistributedConfig | None = None,
) -> TargetCapture:
    """Load the target in `path` (local files only) truncated after its last captured layer, frozen, eval mode.

    distributed_config: this process's shard of a tensor-parallel group (producer/tp.py builds the config;
    torch.distributed joined already), through transformers' own plan for the model; the outputs are
    replicated on every rank.

    layer_ids default to the DFlash formula dflash_layer_ids(N, num_features); id i is the OUTPUT of decoder
    layer i (HF hidden_states[i + 1]).
    """
    path = Path(path)
    config = _read_config(path)
    text = copy.deepcopy(config.get_text_config())
    model_cls = _decoder_class(config, text, path)
    n_layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(n_layers, int):
        raise TargetLoadError(
            f"{path}/config.json: {type(text).__name__} has no num_hidden_layers; the producer needs the decoder's"
            " layer count to choose and truncate the captured layers"
        )
    ids = list(layer_ids) if layer_ids else dflash_layer_ids(n_layers, num_features)
    bad = [i for i in ids if not 0 <= i < n_layers]
    if bad or len(set(ids)) != len(ids):
        raise TargetLoadError(
            f"{path}: target layer ids {ids} must be distinct and within 0..{n_layers - 1} ({n_layers} layers);"
            " set target.layer_ids or fewer target.num_features"
        )
    if dtype not in DTYPES:
        raise TargetLoadError(f"{path}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    keep = max(ids) + 1
    set_layer_count(text, keep)
    attn = choose_attn_implementation(model_cls, attn_implementation, device)
    try:
        check_weight_files(path)
    except WeightFileError as err:
        raise TargetLoadError(str(err)) from None
    arch = _architecture(config)
    try:
        return _load(path, config, text, model_cls, ids, n_layers, dtype, device, attn, distributed_config)
    except TargetLoadError:
        raise
    except Exception as err:
        raise TargetLoadError(
            f"{path}: the {arch} target ({model_cls.__name__}) failed to load: {_what(err, attn)}"
        ) from err


def _load(
    path: Path,
    config: PretrainedConfig,
    text: PretrainedConfig,
    model_cls: type,
    ids: list[int],
    n_layers: int,
    dtype: str,
    device: str,
    attn: str,
    distributed_config: DistributedConfig | None,
) -> TargetCapture:
    keep = max(ids) + 1
    key_mapping = decoder_key_mapping(path, config, model_cls)  # a wrapper's `language_model.model.*` names
    # The skipped layers' weights are "unexpected" by design; the report about them is silenced and any
    # missing weight is turned into an error instead (a random layer would silently corrupt the features).
    report_logger = logging.getLogger("transformers.modeling_utils")
    report_logger.addFilter(_errors_only)
    parallel = {"distributed_config": distributed_config} if distributed_config is not None else {}
    try:
        model, info = AutoModel.from_pretrained(  # the base decoder: the LM head is never read
            path,
            config=text,
            local_files_only=True,
            dtype=DTYPES[dtype],
            attn_implementation=attn,
            output_loading_info=True,
            key_mapping=key_mapping,
            **parallel,
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise TargetLoadError(f"{path}: cannot load the target's weights ({_weights_present(path)}): {err}") from err
    finally:
        report_logger.removeFilter(_errors_only)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise TargetLoadError(f"{path}: {_missing(path, config, missing)}")
    if keep < n_layers and hasattr(model, "norm"):
        model.norm = nn.Identity()  # the final norm only feeds the LM head
    if not hasattr(model, "layers") or len(model.layers) != keep:
        raise TargetLoadError(f"{path}: {type(model).__name__} has no `layers` list of {keep} decoder layers")
    model.requires_grad_(False).eval()
    if distributed_config is None:  # a tensor-parallel shard is already on its rank's device
        model.to(device)
    return TargetCapture(model, model.config, ids, n_layers)


def _decoder_class(config: PretrainedConfig, text: PretrainedConfig, path: Path) -> type:
    """The base decoder class of the text config: that of a causal LM, or the text decoder a generative
    multimodal wrapper holds (Qwen3-VL, Qwen2.5-VL: no causal-LM class for their text config); a clear error
    naming the architecture when neither."""
    decoder = MODEL_MAPPING.get(type(text), None)
    if decoder is not None and (type(text) in MODEL_FOR_CAUSAL_LM_MAPPING or _wraps(config, decoder)):
        return decoder
    raise TargetLoadError(
        f"{path}: unsupported target architecture {_architecture(config)} (model_type {config.model_type!r}):"
        f" transformers has no causal-LM class for its text config {type(text).__name__} (model_type"
        f" {text.model_type!r}) and no generative wrapper in config.architectures holds its text decoder; the"
        " producer runs the text decoder of a causal LM"
    )


def _wraps(config: PretrainedConfig, decoder: type) -> bool:
    """True when the checkpoint's class is a generative model (an LM head) with a `decoder` inside."""
    cls = checkpoint_class(config)
    if cls is None or config is config.get_text_config():
        return False
    wrapper = meta_model(cls, config)
    return bool(submodule_name(wrapper, decoder)) and wrapper.get_output_embeddings() is not None


def _missing(path: Path, config: PretrainedConfig, missing: list[str]) -> str:
    """What the weight files lack, or under which unmapped prefix they hold it."""
    try:
        elsewhere = sorted(k for k in stored_keys(path) if k.endswith("." + missing[0]))
    except WeightFileError:
        elsewhere = []
    if elsewhere:
        return (
            f"{len(missing)} tensor(s) the text decoder needs, e.g. {missing[0]!r}, are stored as {elsewhere[0]!r}:"
            f" under a prefix the conversion mapping of {_architecture(config)} in transformers does not map"
        )
    return f"the weight files lack {len(missing)} tensor(s) the target needs: {missing[:5]}"


def _architecture(config: PretrainedConfig) -> str:
    return ", ".join(getattr(config, "architectures", None) or [config.model_type])


def _what(err: Exception, attn: str) -> str:
    """What went wrong, in words a user can act on."""
    if isinstance(err, KeyError) and err.args and err.args[0] in packed_attention.NAMES:
        return (
            f"its code looks up the attention implementation {err.args[0]!r} in a table of its own that lacks it;"
            ' set target.attn_implementation = "sdpa" or "eager"'
        )
    return f"{type(err).__name__}: {err} (attention implementation {attn!r})"


def _weights_present(path: Path) -> str:
    weights = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    return f"weight files present: {weights}" if weights else "no *.safetensors or *.bin weight files"


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def _read_config(path: Path) -> PretrainedConfig:
    try:
        return read_target_config(path)
    except TargetFolderError as err:
        raise TargetLoadError(str(err)) from None
