"""The in-block rule of sliding layers as SGLang and vLLM read it from a drafter's config.json, and the keys
that make them serve the rule a drafter was trained with (docs/design.md, "Sliding layers").

Both engines decide per layer (vLLM `qwen3_dflash.py::_dflash_layer_causal`, SGLang `models/dflash.py::
_get_dflash_attention_type`): `is_causal` when the config sets it (true: every layer causal, full ones too;
false: every layer attends both ways inside the block); else a sliding layer is causal and a full layer is
not. vLLM also reads `dflash_config.causal` when `is_causal` is absent; SGLang does not. DFlash2 models
inherit the DFlash1 layer in both engines, so the rule is the same for both architectures.

So "causal" exports without `is_causal` (writing true would make the full layers causal as well) and
"bidirectional" exports `is_causal: false`; a drafter with full layers only keeps `is_causal: false`.

Which SGLang releases serve `is_causal: false` in sliding layers (docs/design.md, "Sliding layers", read in the
PyPI wheels 0.5.11-0.5.23): from 0.5.18 (`_get_dflash_attention_type`) with the fa3, flashinfer and triton
backends; 0.5.15-0.5.17 make every sliding layer causal. DFlash2 models exist from 0.5.19, so every SGLang
that serves a DFlash2 drafter serves its bidirectional default as trained on those backends.
"""

from __future__ import annotations

SLIDING = "sliding_attention"
RULES = ("causal", "bidirectional")
SGLANG_HONOURS = "0.5.18"  # the first SGLang release whose DFlash model reads is_causal for sliding layers


class SlidingRuleError(ValueError):
    """A config whose attention rule this project's drafter cannot train (the message says which key)."""


def export_keys(rule: str, layer_types: list[str]) -> dict:
    """The config.json keys that make both engines serve `rule` in the sliding layers of `layer_types`."""
    if rule not in RULES:
        raise ValueError(f"sliding_block_attention must be one of {RULES}, got {rule!r}")
    if SLIDING in layer_types and rule == "causal":
        return {}  # absent: both engines make sliding layers causal and full layers bidirectional
    return {"is_causal": False}


def served_rule(config: dict, source: str) -> str | None:
    """The in-block rule SGLang and vLLM apply to the sliding layers of the drafter `config` describes
    (None when it has no sliding layer); SlidingRuleError when they would make its full layers causal."""
    kinds = config.get("layer_types") or []
    is_causal = config.get("is_causal")
    key = "is_causal"
    if is_causal is None:
        is_causal = (config.get("dflash_config") or {}).get("causal")
        key = "dflash_config.causal"
    if is_causal:
        raise SlidingRuleError(
            f"{source}: {key} = true makes every layer causal in SGLang and vLLM, full-attention layers too;"
            " a DFlash block attends both ways in full layers, so this drafter cannot be trained here"
        )
    if SLIDING not in kinds:
        return None
    return "causal" if is_causal is None else "bidirectional"


def serving_caveats(rule: str, layer_types: list[str], window: int | None, block_size: int) -> list[str]:
    """What a server must know to serve this drafter exactly as trained (logged at start-up)."""
    if SLIDING not in layer_types:
        return []
    notes = []
    if rule == "bidirectional":
        notes.append(
            "sliding_block_attention = 'bidirectional' is exported as is_causal: false, which vLLM and SGLang from"
            f" {SGLANG_HONOURS} honour with the fa3, flashinfer and triton attention backends; SGLang 0.5.15-0.5.17"
            " serve sliding layers causally whatever the export says, its torch_native backend drops the window of"
            " a non-causal layer (the block sees context past sliding_window) and trtllm_mha counts the window from"
            " the block's last slot (earlier slots see up to block_size-1 fewer context keys): train"
            " sliding_block_attention = 'causal' for those"
        )
        if window is not None and window < block_size:
            notes.append(
                f"sliding_window {window} < block_size {block_size} with a bidirectional block: training lets slot"
                f" k see slots k' with |k - k'| < {window}; how the engines bound keys after the query in a"
                " non-causal sliding layer is not established, so serve-time drafts may differ"
            )
    if any(k != SLIDING for k in layer_types):
        notes.append(
            "full and sliding layers mixed: vLLM serves such a drafter only with its V2 model runner"
            " (VLLM_USE_V2_MODEL_RUNNER=1; qwen3_dflash.py raises otherwise)"
        )
    return notes
