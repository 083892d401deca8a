"""Does a checkpoint fit the job's drafter? The keys its weights and optimizer state depend on.

save_checkpoint records them in trainer_state.pt ("shape"); a checkpoint written before has them read from
its export config.json (load_latest). The consumer compares them with its own drafter before loading, so a
changed block_size or num_layers is one line naming the key and both values, never a traceback or torch's
"Missing key(s) in state_dict".
"""

from __future__ import annotations

# key -> (its place in the export config.json, the job key that sets it); "optimizer" is in trainer_state only
SHAPE_KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    "block_size": (("block_size",), "drafters.block_size"),
    "num_layers": (("num_hidden_layers",), "drafters.num_layers"),
    "layer_types": (("layer_types",), "drafters.layer_types"),
    "sliding_window": (("sliding_window",), "drafters.sliding_window"),
    "target_layer_ids": (("dflash_config", "target_layer_ids"), "target.layer_ids or target.num_features"),
    "mask_token_id": (("dflash_config", "mask_token_id"), "drafters.mask_token_id, or the tokenizer's"),
    "hidden_size": (("hidden_size",), "the target's hidden_size (target.path)"),
    "intermediate_size": (("intermediate_size",), "the target's intermediate_size (target.path)"),
    "num_attention_heads": (("num_attention_heads",), "the target's num_attention_heads (target.path)"),
    "num_key_value_heads": (("num_key_value_heads",), "the target's num_key_value_heads (target.path)"),
    "head_dim": (("head_dim",), "the target's head_dim (target.path)"),
    "vocab_size": (("vocab_size",), "the target's vocab_size (target.path)"),
    "architectures": (("architectures",), "drafters.arch"),
    "selector_rank": (("dflash_config", "selector_rank"), "drafters.selector_rank"),
    "conv_group_size": (("dflash_config", "conv_group_size"), "drafters.conv_group_size"),
    "conv_kernel_size": (("dflash_config", "conv_kernel_size"), "drafters.conv_kernel_size"),
    "markov_rank": (("markov_rank",), "drafters.markov_rank"),
    "output_multiplier": (("dflash_config", "output_multiplier"), "drafters.output_multiplier"),
    "final_logit_softcapping": (("dflash_config", "final_logit_softcapping"), "drafters.final_logit_softcapping"),
    "selector_vocab_size": (("dflash_config", "selector_vocab_size"), "drafters.selector_vocab_size"),
    "optimizer": ((), "the optimizer (AdamW)"),
}


class ShapeMismatch(ValueError):
    """A checkpoint trained with another drafter shape than the job's: one line naming the key and both values."""


def shape_from_config(config: dict) -> dict:
    """The shape keys an export config.json carries."""
    shape = {}
    for key, (where, _) in SHAPE_KEYS.items():
        value: object = config
        for part in where:
            value = value.get(part) if isinstance(value, dict) else None
        if where and value is not None:
            shape[key] = value
    return shape


def check_shape(state: dict, mine: dict, drafter: str, source: str) -> None:
    """ShapeMismatch unless the checkpoint state's "shape" fits `mine` (the job's drafter_shape); keys the
    checkpoint does not record are not compared."""
    theirs = state.get("shape") or {}
    for key, (_, job_key) in SHAPE_KEYS.items():
        if key in theirs and key in mine and _plain(theirs[key]) != _plain(mine[key]):
            raise ShapeMismatch(
                f"drafter {drafter}: {source} was trained with {key} = {theirs[key]!r}, this job has {key} ="
                f" {mine[key]!r} ({job_key}): its weights and optimizer state do not fit; set it back to"
                f" {theirs[key]!r}, or train the new shape in a new run folder (job.run_dir)"
            )


def _plain(value):
    return list(value) if isinstance(value, tuple) else value
