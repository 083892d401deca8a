"""Warm start: a drafter begins from a published drafter directory (`init_from` in its [[drafters]] table).

Accepted directories: z-lab's layout (config.json + model.safetensors, or shards listed in
model.safetensors.index.json; DFlash keys possibly only inside `dflash_config`, no training state), our
exports and step_<N> checkpoints, or a checkpoint root (its `latest`). Only the weights are taken: the
optimizer, schedule, step and data cursor start fresh. The job's own checkpoints take precedence: once the
drafter has one, a restart resumes it and init_from is not read again.

Before any tensor is copied, the directory's config is checked against the drafter the job builds (target
layer ids, hidden size, block size, vocabulary, layers, heads, intermediate size, layer kinds and window,
mask token, the sliding layers' in-block rule as the engines serve it); then every tensor's name and shape.
A mismatch is one line naming the file, the key, what it holds and what the job has (exit 2 at start-up).
`may_be_missing` names parameters the directory may lack (a DFlash2 or DSpark drafter warm-started from a DFlash1
one): they keep their initialisation (identity for DFlash2's new parts).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from common.checkpoint_pointer import read_pointer
from common.config import DrafterConfig, dflash_layer_ids
from consumer.dflash2 import DFlash2Drafter
from consumer.dspark import DSPARK_ARCHITECTURE, DSparkDrafter
from consumer.export.layout import trainer_export_config
from consumer.sliding_rule import SlidingRuleError, served_rule

log = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class WarmStartError(ValueError):
    """A directory init_from cannot start this drafter from; the message names the file and the fault."""


def resolve_dir(path: str | Path) -> Path:
    """The drafter directory `path` names: itself, or the checkpoint its `latest` points at."""
    root = Path(path).expanduser()
    if (name := read_pointer(root)) is not None:
        root = root / name
    if not root.is_dir():
        raise WarmStartError(f"init_from {path}: {root} is not a directory")
    if not (root / CONFIG).is_file():
        raise WarmStartError(f"init_from {path}: {root / CONFIG} is missing (expected a DFlash drafter directory)")
    return root


def read_config(root: Path) -> dict:
    file = root / CONFIG
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise WarmStartError(f"{file} is unreadable: {err}") from None
    if not isinstance(config, dict):
        raise WarmStartError(f"{file} holds no JSON object")
    return config


def _dflash(config: dict, key: str):
    """A DFlash key where the engines look for it: dflash_config first, then the top level."""
    inner = config.get("dflash_config") or {}
    return inner[key] if key in inner else config.get(key)


# DFlash2's optional serving keys (consumer/dflash2.py DFlash2Shape): a job that leaves them unset takes them from
# its init_from directory (`with_published_serving_keys`), a job that sets them must agree with it (check_config)
DFLASH2_SERVING_KEYS = ("output_multiplier", "final_logit_softcapping", "selector_vocab_size")


def with_published_serving_keys(cfg: DrafterConfig) -> DrafterConfig:
    """`cfg` with the DFlash2 serving keys it leaves unset taken from its init_from directory's config.json
    (dflash_config, or the top level), e.g. z-lab's output_multiplier 0.196 and final_logit_softcapping 20; the
    same config otherwise (not DFlash2, no init_from, a key the job sets, or a directory that cannot be read: the
    warm start names that one)."""
    if cfg.arch != "dflash2" or cfg.init_from is None:
        return cfg
    try:
        config = read_config(resolve_dir(cfg.init_from))
    except WarmStartError:
        return cfg
    found = {k: _dflash(config, k) for k in DFLASH2_SERVING_KEYS if getattr(cfg, k) is None}
    found = {k: v for k, v in found.items() if v is not None}
    if found:
        log.info(
            "drafter %s: %s from init_from %s",
            cfg.name,
            ", ".join(f"{k} = {v}" for k, v in found.items()),
            cfg.init_from,
        )
    return cfg.model_copy(update=found) if found else cfg


def published_shape(config: dict, source: str) -> dict:
    """The shape keys of a published config.json, read as SGLang reads them (None: not stated)."""
    kinds = config.get("layer_types")
    n_layers = config.get("num_hidden_layers")
    ids = _dflash(config, "target_layer_ids")
    if ids is None and config.get("num_target_layers") and n_layers:  # SGLang's default for a config without
        ids = dflash_layer_ids(int(config["num_target_layers"]), int(n_layers))
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    sliding = "sliding_attention" in (kinds or [])
    try:
        rule = served_rule(config, source)
    except SlidingRuleError as err:
        raise WarmStartError(str(err)) from None
    rope = config.get("rope_parameters") or {}
    return {
        "target_layer_ids": list(ids) if ids is not None else None,
        "hidden_size": hidden,
        "block_size": _dflash(config, "block_size") or 16,  # z-lab's and SGLang's reader default
        "vocab_size": config.get("vocab_size"),
        "num_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads", heads),
        "head_dim": config.get("head_dim") or (hidden // heads if hidden and heads else None),
        "intermediate_size": config.get("intermediate_size"),
        "layer_types": list(kinds) if kinds else (["full_attention"] * n_layers if n_layers else None),
        "sliding_window": config.get("sliding_window") if sliding else None,
        "sliding_block_attention": rule,
        "mask_token_id": _dflash(config, "mask_token_id"),
        "rope_theta": config.get("rope_theta", rope.get("rope_theta")),
        "num_target_layers": _dflash(config, "num_target_layers"),
        **{key: _dflash(config, key) for key in DFLASH2_SERVING_KEYS},
    }


# key -> the job key that sets it (what to change when they differ)
JOB_KEYS = {
    "target_layer_ids": "target.layer_ids or target.num_features",
    "hidden_size": "the target's hidden_size (target.path)",
    "block_size": "drafters.block_size",
    "vocab_size": "the target's vocab_size (target.path)",
    "num_layers": "drafters.num_layers",
    "num_attention_heads": "the target's num_attention_heads (target.path)",
    "num_key_value_heads": "the target's num_key_value_heads (target.path)",
    "head_dim": "the target's head_dim (target.path)",
    "intermediate_size": "the target's intermediate_size (target.path)",
    "layer_types": "drafters.layer_types",
    "sliding_window": "drafters.sliding_window",
    "sliding_block_attention": "drafters.sliding_block_attention (exported as is_causal)",
    "mask_token_id": "drafters.mask_token_id",
    "rope_theta": "drafters.rope_theta",
    "num_target_layers": "the target's num_hidden_layers (target.path)",
    "output_multiplier": "drafters.output_multiplier",
    "final_logit_softcapping": "drafters.final_logit_softcapping",
    "selector_vocab_size": "drafters.selector_vocab_size",
}


DFLASH1 = ["DFlashDraftModel"]


def check_config(config: dict, mine: dict, source: str, drafter: str, grows_from_dflash1: bool = False) -> None:
    """WarmStartError at the first key where the published config differs from the job's drafter (`mine`:
    its own export config). grows_from_dflash1: the job's architecture extends DFlash1 (its extra parameters
    may be missing), so a DFlash1 directory fits it too."""
    theirs_arch, my_arch = config.get("architectures") or DFLASH1, mine.get("architectures") or DFLASH1
    if theirs_arch != my_arch and not (grows_from_dflash1 and theirs_arch == DFLASH1):
        raise WarmStartError(f"{source}: architectures = {theirs_arch!r}, but drafter {drafter} is {my_arch!r}")
    theirs, mine = published_shape(config, source), published_shape(mine, "the job's drafter")
    if theirs["target_layer_ids"] is None:
        raise WarmStartError(
            f"{source}: no dflash_config.target_layer_ids (nor num_target_layers to derive"
            " them): the target features the drafter was trained on are unknown"
        )
    # DSpark from DFlash1: the copied weights (layers, fc, norms) do not depend on the block size, and DSpark's
    # slots mean another thing (each predicts the next token), so peers train it at its own block size
    into_dspark = grows_from_dflash1 and my_arch == [DSPARK_ARCHITECTURE] and theirs_arch == DFLASH1
    for key, job_key in JOB_KEYS.items():
        if into_dspark and key == "block_size":
            continue
        found, want = theirs[key], mine[key]
        if found is None or (key == "sliding_block_attention" and want is None):
            continue  # not stated there (the tensors' shapes still are checked), or no sliding layer here
        same = (
            abs(float(found) - float(want)) <= 1e-6 * abs(float(want))
            if key == "rope_theta"
            else _plain(found) == _plain(want)
        )
        if not same:
            raise WarmStartError(
                f"{source}: {_stated(config, key, found)}, but drafter {drafter} has {key} = {want!r} ({job_key}):"
                " the published weights do not fit this job; change the job to match or start from another"
                " directory"
            )


def _stated(config: dict, key: str, found) -> str:
    """Where and how the published config says `key` (found: its value as published_shape reads it)."""
    if key == "sliding_block_attention":
        return (
            f"is_causal = {config['is_causal']!r}" if "is_causal" in config else "no is_causal"
        ) + f" (the engines serve its sliding layers' block {found})"
    if key in ("target_layer_ids", "block_size", "mask_token_id"):
        place = f"dflash_config.{key}" if key in (config.get("dflash_config") or {}) else key
        return f"{place} = {found!r}"
    return f"{'num_hidden_layers' if key == 'num_layers' else key} = {found!r}"


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def read_weights(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory: model.safetensors, or the shards its index lists."""
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({str(f) for f in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise WarmStartError(f"{index} is unreadable: {type(err).__name__}: {err}") from None
    elif (root / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise WarmStartError(f"{root}: neither {WEIGHTS} nor {INDEX} (the drafter's weights) is there")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        file = root / name
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    state[key] = f.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise WarmStartError(f"{file} cannot be read: {err}") from None
    return state


def check_tensors(
    state: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    may_be_missing: frozenset[str],
    source: str,
    drafter: str,
) -> dict[str, torch.Tensor]:
    """The published tensors under the drafter's names (a leading "model." dropped, as SGLang does), each
    with the shape of its parameter; WarmStartError names the first missing, unexpected or misshapen one."""
    named = {
        k.removeprefix("model.") if k not in params and k.removeprefix("model.") in params else k: v
        for k, v in state.items()
    }
    unexpected = sorted(set(named) - set(params))
    if unexpected:
        raise WarmStartError(
            f"{source}: tensor(s) {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''} are not"
            f" parameters of drafter {drafter} (another architecture?)"
        )
    missing = sorted(set(params) - set(named) - may_be_missing)
    if missing:
        raise WarmStartError(
            f"{source}: drafter {drafter}'s parameter(s) {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''} are missing there"
        )
    for key, tensor in named.items():
        if tuple(tensor.shape) != tuple(params[key].shape):
            raise WarmStartError(
                f"{source}: tensor {key} has shape {list(tensor.shape)}, drafter {drafter}'s"
                f" parameter has {list(params[key].shape)}"
            )
    return named


def job_config(trainer) -> dict:
    """The export config.json of the drafter `trainer` builds: what a published one is compared with."""
    return trainer_export_config(trainer)


def grown_parameters(model, config: dict) -> frozenset[str]:
    """The parameters a DFlash2 drafter may keep at their identity initialisation when the directory is a
    DFlash1 drafter's (consumer/dflash2.py); nothing otherwise."""
    from_dflash1 = (config.get("architectures") or DFLASH1) == DFLASH1
    if isinstance(model, DFlash2Drafter) and from_dflash1:
        return frozenset(model.identity_init_params(model.arch.num_layers))
    if isinstance(model, DSparkDrafter) and from_dflash1:  # the Markov and confidence heads start fresh
        return frozenset(model.HEAD_PARAMS)
    return frozenset()


def warm_start(trainer, path: str | Path, may_be_missing: frozenset[str] | None = None) -> Path:
    """Copy the weights of the drafter directory `path` into trainer.model (before FSDP shards it), after
    checking its config and tensors against the job's drafter; returns the directory read. The optimizer is
    the trainer's fresh one (no state yet), at step 0. `may_be_missing`: parameters the directory may lack
    (None: `grown_parameters`, a DFlash1 directory into a DFlash2 drafter)."""
    root = resolve_dir(path)
    config = read_config(root)
    if may_be_missing is None:
        may_be_missing = grown_parameters(trainer.model, config)
    check_config(config, job_config(trainer), str(root / CONFIG), trainer.cfg.name, bool(may_be_missing))
    params = dict(trainer.model.named_parameters())
    named = check_tensors(read_weights(root), params, frozenset(may_be_missing), str(root), trainer.cfg.name)
    with torch.no_grad():
        for key, tensor in named.items():
            params[key].copy_(tensor.to(params[key].dtype))
    kept = sorted(set(params) - set(named))
    log.info(
        "drafter %s starts from %s: %d tensors copied%s; fresh optimizer at step 0",
        trainer.cfg.name,
        root,
        len(named),
        f", {len(kept)} new, kept at their initialisation ({', '.join(kept[:8])}{' ...' if len(kept) > 8 else ''})"
        if kept
        else "",
    )
    return root


def warm_start_unless_resuming(trainer, ckpt_root: str | Path) -> None:
    """The consumer's entry: warm-start from the drafter's init_from, unless the job already has a checkpoint
    of this drafter in ckpt_root (a restart resumes that; init_from only ever seeds step 0)."""
    path = trainer.cfg.init_from
    if path is None:
        return
    if read_pointer(ckpt_root) is not None:
        log.info(
            "drafter %s: init_from %s is not read: the job's own checkpoint in %s is resumed instead",
            trainer.cfg.name,
            path,
            ckpt_root,
        )
        return
    warm_start(trainer, path)
