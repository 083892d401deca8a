"""Tiny random targets of every architecture the project supports, saved exactly like a download.

`build_target(arch, out_dir)` builds a random model from transformers' own config class for `arch` (tiny dims,
2-4 decoder layers), saves `config.json` + `model.safetensors` + a byte-level tokenizer with a ChatML chat
template into `out_dir`, and returns `out_dir`. Nothing is downloaded. The shapes exercise what real
checkpoints have: MoE routing, MLA (DeepSeek-V3), sliding windows shorter than the test sequences, attention
sinks (gpt-oss), Gated DeltaNet linear attention (qwen3_next, qwen3_5), llama3 RoPE scaling, per-layer-type
RoPE (gemma3), and the Qwen3.6-27B multimodal wrapper (`Qwen3_5ForConditionalGeneration`: text decoder under
`model.language_model.`, a vision tower under `model.visual.`).

Stable API (the drafter matrix builds on it): ARCHS (packed), FALLBACK_ARCHS (per-sequence), EXAMPLES, SLIDING_WINDOW, VOCAB_SIZE, MASK_ID, EOS_ID,
build_target(arch, out_dir, *, seed=0, num_layers=None), build_tokenizer(out_dir=None), text_config(arch).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GptOssConfig,
    Lfm2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
PAD_ID, IM_START_ID, EOS_ID, MASK_ID = range(len(SPECIAL_TOKENS))
VOCAB_SIZE = 320  # 4 specials + 256 bytes + spare rows, as real checkpoints pad their embedding
SLIDING_WINDOW = 8  # shorter than the sequences the tests pack, so a window leak would show

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# A published model of each family (for the README's table; nothing is downloaded).
EXAMPLES: dict[str, str] = {
    "llama": "meta-llama/Llama-2-7b-hf",
    "llama3_rope": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen2": "Qwen/Qwen2.5-7B-Instruct",
    "qwen3": "Qwen/Qwen3-8B",
    "qwen3_moe": "Qwen/Qwen3-30B-A3B",
    "mistral_sliding": "mistralai/Mistral-7B-v0.1",
    "gemma3_text": "google/gemma-3-1b-it",
    "gpt_oss": "openai/gpt-oss-20b",
    "qwen3_next": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "qwen3_5_text": "Qwen/Qwen3.5-27B (text decoder)",
    "qwen3_5_vl": "Qwen/Qwen3.6-27B",
    "qwen3_5_moe": "Qwen/Qwen3.5-35B-A3B",
    "deepseek_v3": "deepseek-ai/DeepSeek-V3",
    "glm4_moe": "zai-org/GLM-4.5-Air",
    "lfm2": "LiquidAI/LFM2-1.2B",
}

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=PAD_ID,
    bos_token_id=None,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
)
_LINEAR = dict(  # Gated DeltaNet dims; 4 layers = 3 linear + 1 full (full_attention_interval 4)
    num_hidden_layers=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _cfg(cls: type[PretrainedConfig], **kw) -> Callable[..., PretrainedConfig]:
    args = {**_COMMON, "num_hidden_layers": 3, **kw}

    def make(num_layers: int | None = None) -> PretrainedConfig:
        final = dict(args)
        if num_layers is not None:
            final["num_hidden_layers"] = num_layers
            if final.get("layer_types"):  # repeat the pattern; hybrid configs derive theirs from the count
                final["layer_types"] = [args["layer_types"][i % len(args["layer_types"])] for i in range(num_layers)]
        return cls(**{k: v for k, v in final.items() if v is not _DERIVED})

    return make


_DERIVED = object()  # leave the field to the config class (DeepSeek-V3 derives head_dim from its MLA dims)


_CONFIGS: dict[str, Callable[..., PretrainedConfig]] = {
    "llama": _cfg(LlamaConfig),
    "llama3_rope": _cfg(
        LlamaConfig,
        rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=64,
        ),
    ),
    "qwen2": _cfg(Qwen2Config, tie_word_embeddings=True),
    "qwen3": _cfg(Qwen3Config, tie_word_embeddings=True),
    "qwen3_moe": _cfg(Qwen3MoeConfig, **_MOE),
    "mistral_sliding": _cfg(MistralConfig, sliding_window=SLIDING_WINDOW),
    "gemma3_text": _cfg(
        Gemma3TextConfig,
        tie_word_embeddings=True,
        query_pre_attn_scalar=16,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "gpt_oss": _cfg(
        GptOssConfig,
        max_position_embeddings=131072,  # = yarn's original 4096 x factor 32, as the published config
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "qwen3_next": _cfg(
        Qwen3NextConfig, **_LINEAR, **_MOE, shared_expert_intermediate_size=32, decoder_sparse_step=1
    ),
    "qwen3_5_text": _cfg(Qwen3_5TextConfig, **_LINEAR),
    "qwen3_5_moe": _cfg(  # MoE-only like the published config: no dense intermediate_size
        Qwen3_5MoeTextConfig, **_LINEAR, **_MOE, shared_expert_intermediate_size=32, intermediate_size=_DERIVED
    ),
    "deepseek_v3": _cfg(
        DeepseekV3Config,
        head_dim=_DERIVED,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
    ),
    "glm4_moe": _cfg(
        Glm4MoeConfig,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
    ),
    # short-convolution layers with no packed path: the producer runs it one forward per sequence
    "lfm2": _cfg(Lfm2Config, head_dim=_DERIVED, layer_types=["conv", "full_attention", "conv"]),
}

FALLBACK_ARCHS: list[str] = ["lfm2"]  # supported through the per-sequence fallback only
ARCHS: list[str] = [*(a for a in _CONFIGS if a not in FALLBACK_ARCHS), "qwen3_5_vl"]


def text_config(arch: str, num_layers: int | None = None) -> PretrainedConfig:
    """The (text) config `build_target(arch, ...)` uses for the decoder (default 3 layers, hybrids 4)."""
    if arch == "qwen3_5_vl":
        arch = "qwen3_5_text"
    if arch not in _CONFIGS:
        raise ValueError(f"unknown zoo architecture {arch!r}; choose one of {ARCHS}")
    return _CONFIGS[arch](num_layers)


def build_tokenizer(out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (every byte is one token; ids 0-3 are the specials) with ChatML specials and chat template."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(byte_chars)})
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|MASK|>",
        chat_template=CHATML_TEMPLATE,
    )
    if out_dir is not None:
        tok.save_pretrained(str(out_dir))
    return tok


def build_target(arch: str, out_dir: str | Path, *, seed: int = 0, num_layers: int | None = None) -> Path:
    """Save a random `arch` target (fp32 weights) with its tokenizer into `out_dir`; return `out_dir`."""
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    if arch == "qwen3_5_vl":
        config = Qwen3_5Config(
            text_config=text_config(arch, num_layers).to_dict(),
            vision_config=dict(
                depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                patch_size=4, num_position_embeddings=16,
            ),
            tie_word_embeddings=False,
        )
        model = Qwen3_5ForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(text_config(arch, num_layers), dtype=torch.float32)
    model.eval().save_pretrained(str(out_dir))
    build_tokenizer(out_dir)
    return out_dir
