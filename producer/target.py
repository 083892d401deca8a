"""The frozen target: load a local HF causal LM and capture the hidden states the drafter is conditioned on.

Only the decoder stack up to the last captured layer is ever built: `load_target` reads the config, cuts
`num_hidden_layers` to `max(layer_ids) + 1` before loading (the later layers' weights are never read into
memory), drops the LM head and the final norm (kept only when the last layer itself is captured, since HF's
hidden_states[N] is normed). The forward is then the model's own forward, so rotary
embeddings, attention kernels and layer internals stay exactly the library's; forward hooks on the captured
layers copy each output into its column block of the feature buffer. Compared to hooks on a full model that
abort with an exception, nothing after the last layer is allocated or run, and no control flow is hijacked;
compared to calling the layers by hand, no per-architecture layer signature is reimplemented.

Packed batches: the tokens of B sequences lie end to end ([T] with cu_seqlens [B+1]). Position ids restart
at 0 for every sequence, and the attention mask is the library's causal mask intersected with "same
sequence" (a block-diagonal causal mask), built from host-side cu_seqlens, so no device sync is needed.
A single sequence skips the mask (plain causal attention). On the CPU the one masked forward beat a loop
over sequences by 2.7x on 2,048-token batches of ~250-token chats (bench/producer.py,
`packed_over_per_sequence`): the loop pays the layer stack's Python overhead once per sequence, the mask
only wastes attention FLOPs across sequences. On CUDA, flex_attention turns the same mask into a
block-sparse one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.masking_utils import (
    create_causal_mask,
    create_sliding_window_causal_mask,
    packed_sequence_mask_function,
)

from common.config import dflash_layer_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetLoadError(RuntimeError):
    """The target directory cannot be used; the message names the path and what is missing."""


class TargetCapture:
    """A frozen, truncated target that returns concat(outputs of decoder layers in `layer_ids`) per token."""

    def __init__(
        self, model: nn.Module, config: PretrainedConfig, layer_ids: list[int], num_target_layers: int
    ):
        self.model = model  # the base decoder (no LM head), truncated after max(layer_ids)
        self.config = config
        self.layer_ids = list(layer_ids)
        self.num_target_layers = num_target_layers
        self.hidden_size = int(config.hidden_size)
        self.param = next(model.parameters())
        self._out: torch.Tensor | None = None
        # HF's hidden_states[N] is the final-normed output, so the last layer is read from the model output
        self.last_block = (
            self.layer_ids.index(num_target_layers - 1) if num_target_layers - 1 in layer_ids else None
        )
        for k, i in enumerate(self.layer_ids):
            if k != self.last_block:
                model.layers[i].register_forward_hook(self._copy_hook(k))

    @property
    def device(self) -> torch.device:
        return self.param.device

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    @property
    def feature_width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def layers_run(self) -> int:
        return len(self.model.layers)

    def _copy_hook(self, k: int):
        h = self.hidden_size

        def hook(_module, _args, output):
            hidden = output[0] if isinstance(output, tuple) else output  # [1, T, H]
            self._out[:, k * h : (k + 1) * h].copy_(hidden[0])

        return hook

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [T] (any device), cu_seqlens [B+1] int on the host → features [T, n·H] in the target dtype.

        `out` (optional, [T, n·H], target dtype, on the target's device) receives the features in place, e.g.
        a view into a ring slot, so they are written once.
        """
        total = int(input_ids.shape[0])
        lengths = torch.diff(cu_seqlens.to("cpu", torch.int64))
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total or bool((lengths <= 0).any()):
            raise ValueError(
                f"cu_seqlens {cu_seqlens.tolist()} does not split {total} tokens into non-empty runs"
            )
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [T]
        positions = torch.arange(total) - (cu_seqlens[:-1].to(torch.int64))[seq_idx]  # restart per sequence
        dev = self.device
        ids = input_ids.to(dev, non_blocking=True).view(1, total)
        positions = positions.to(dev, non_blocking=True).view(1, total)
        seq_idx = seq_idx.to(dev, non_blocking=True).view(1, total)
        if out is None:
            out = torch.empty(total, self.feature_width, dtype=self.dtype, device=dev)
        elif out.shape != (total, self.feature_width) or out.dtype != self.dtype or out.device != dev:
            raise ValueError(
                f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected"
                f" {(total, self.feature_width)} {self.dtype} on {dev}"
            )
        embeds = self.model.get_input_embeddings()(ids)  # [1, T, H]
        self._out = out
        try:
            result = self.model(
                inputs_embeds=embeds,
                attention_mask=self.packed_attention_mask(embeds, seq_idx) if len(lengths) > 1 else None,
                position_ids=positions,
            )
        finally:
            self._out = None
        if self.last_block is not None:
            h = self.hidden_size
            out[:, self.last_block * h : (self.last_block + 1) * h].copy_(result.last_hidden_state[0])
        return out

    __call__ = forward

    def packed_attention_mask(self, embeds: torch.Tensor, seq_idx: torch.Tensor):
        """Block-diagonal causal mask(s) in the format the model's attention implementation wants."""
        same_sequence = packed_sequence_mask_function(seq_idx)
        kwargs = dict(config=self.config, inputs_embeds=embeds, attention_mask=None, cache=None)
        layer_types = set(getattr(self.config, "layer_types", None) or ["full_attention"])
        makers = {
            "full_attention": create_causal_mask,
            "sliding_attention": create_sliding_window_causal_mask,
        }
        unknown = layer_types - makers.keys()
        if unknown:
            raise NotImplementedError(f"packed masks for layer types {sorted(unknown)} are not supported")
        masks = {t: makers[t](**kwargs, and_mask_function=same_sequence) for t in layer_types}
        if any(m is None for m in masks.values()):
            raise NotImplementedError(
                f"attention implementation {self.config._attn_implementation!r} builds no packed mask;"
                " use eager, sdpa or flex_attention"
            )
        # a ready 4D mask is passed through as-is by every model's mask preparation
        return masks["full_attention"] if layer_types == {"full_attention"} else masks


def load_target(
    path: str | Path,
    layer_ids: list[int] | None = None,
    num_features: int = 5,
    dtype: str = "bfloat16",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
) -> TargetCapture:
    """Load the target in `path` (local files only) truncated after its last captured layer, frozen, eval mode.

    layer_ids default to the DFlash formula dflash_layer_ids(N, num_features); id i is the OUTPUT of decoder
    layer i (HF hidden_states[i + 1]).
    """
    path = Path(path)
    config = _read_config(path)
    n_layers = int(config.num_hidden_layers)
    ids = list(layer_ids) if layer_ids else dflash_layer_ids(n_layers, num_features)
    bad = [i for i in ids if not 0 <= i < n_layers]
    if bad or len(set(ids)) != len(ids):
        raise TargetLoadError(
            f"{path}: target layer ids {ids} must be distinct and within 0..{n_layers - 1} ({n_layers} layers);"
            " set target.layer_ids or fewer target.num_features"
        )
    keep = max(ids) + 1
    config.num_hidden_layers = keep
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:keep]
    if dtype not in DTYPES:
        raise TargetLoadError(f"{path}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    # The skipped layers' weights are "unexpected" by design; the report about them is silenced and any
    # missing weight is turned into an error instead (a random layer would silently corrupt the features).
    report_logger = logging.getLogger("transformers.modeling_utils")
    report_logger.addFilter(_errors_only)
    try:
        full, info = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            local_files_only=True,
            dtype=DTYPES[dtype],
            attn_implementation=attn_implementation,
            output_loading_info=True,
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        weights = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
        found = f"weight files present: {weights}" if weights else "no *.safetensors or *.bin weight files"
        raise TargetLoadError(f"{path}: cannot load the target's weights ({found}): {err}") from err
    finally:
        report_logger.removeFilter(_errors_only)
    missing = sorted(k for k in info["missing_keys"] if not k.startswith("lm_head"))
    if missing:
        raise TargetLoadError(
            f"{path}: the weight files lack {len(missing)} tensor(s) the target needs: {missing[:5]}"
        )
    model = full.get_decoder()
    del full  # drops the LM head
    if keep < n_layers and hasattr(model, "norm"):
        model.norm = nn.Identity()  # the final norm only feeds the LM head
    if not hasattr(model, "layers") or len(model.layers) != keep:
        raise TargetLoadError(f"{path}: {type(model).__name__} has no `layers` list of {keep} decoder layers")
    model.requires_grad_(False).eval().to(device)
    return TargetCapture(model, model.config, ids, n_layers)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def _read_config(path: Path) -> PretrainedConfig:
    if not path.is_dir():
        raise TargetLoadError(f"{path}: target model directory does not exist")
    if not (path / "config.json").is_file():
        raise TargetLoadError(f"{path}: no config.json in the target model directory")
    try:
        json.loads((path / "config.json").read_text())
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise TargetLoadError(f"{path}/config.json: not a usable model config: {err}") from err
