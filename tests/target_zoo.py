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
    FalconH1Config,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GptOssConfig,
    JambaConfig,
    Lfm2Config,
    Llama4Config,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
    LlamaConfig,
    MambaConfig,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig,
    Qwen2Config,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLTextConfig,
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
    "gemma3_vl": "google/gemma-3-27b-it",
    "mistral3_vl": "mistralai/Mistral-Small-3.2-24B-Instruct-2506",
    "qwen3_vl": "Qwen/Qwen3-VL-8B-Instruct",
    "qwen2_5_vl": "Qwen/Qwen2.5-VL-7B-Instruct",
    "llama4_vl": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "falcon_h1": "tiiuae/Falcon-H1-7B-Instruct",
    "jamba": "ai21labs/AI21-Jamba-Mini-1.7",
    "mamba": "state-spaces/mamba-2.8b-hf",
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
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
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
    "qwen3_next": _cfg(Qwen3NextConfig, **_LINEAR, **_MOE, shared_expert_intermediate_size=32, decoder_sparse_step=1),
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
    "mistral3_text": _cfg(MistralConfig),
    # multimodal RoPE (3 position rows: text, height, width); text-only input gives three identical rows
    "qwen3_vl_text": _cfg(
        Qwen3VLTextConfig,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2], mrope_interleaved=True),
    ),
    "qwen2_5_vl_text": _cfg(
        Qwen2_5_VLTextConfig, rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2])
    ),
    "llama4_text": _cfg(  # MoE every layer, chunked attention shorter than the test sequences, NoPE layers
        Llama4TextConfig,
        num_hidden_layers=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        intermediate_size_mlp=128,
        interleave_moe_layer_step=1,
        no_rope_layers=[1, 0],
        attention_chunk_size=8,
    ),
    # state-space hybrids and a pure state-space model: their mixers keep a recurrent state across tokens
    "falcon_h1": _cfg(  # every layer: attention and a Mamba-2 mixer side by side
        FalconH1Config,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
    ),
    "jamba": _cfg(  # Mamba layers, one attention layer of two, MoE every other layer
        JambaConfig,
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        head_dim=_DERIVED,
    ),
    "mamba": _cfg(  # pure state space: no attention at all
        MambaConfig,
        state_size=8,
        expand=2,
        conv_kernel=4,
        use_mambapy=False,
        **{
            k: _DERIVED
            for k in (
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
            )
        },
    ),
}

# multimodal wrappers, saved the way save_pretrained writes the published checkpoints (text decoder + vision
# tower): the zoo name → the text architecture inside it
WRAPPERS = {
    "qwen3_5_vl": "qwen3_5_text",
    "gemma3_vl": "gemma3_text",
    "mistral3_vl": "mistral3_text",
    "qwen3_vl": "qwen3_vl_text",
    "qwen2_5_vl": "qwen2_5_vl_text",
    "llama4_vl": "llama4_text",
}
# supported through the per-sequence fallback only: a short convolution (lfm2), Mamba mixers (falcon_h1, jamba,
# mamba) keep a state across tokens that a packed forward would carry from one sequence into the next
FALLBACK_ARCHS: list[str] = ["lfm2", "falcon_h1", "jamba", "mamba"]
_TEXT_ONLY = {"mistral3_text", "qwen3_vl_text", "qwen2_5_vl_text", "llama4_text"}  # built inside their wrapper only
# Llama 4's wrapper cannot run a text-only forward in transformers 5.24 (its output lacks `image_outputs`): the
# producer and the parts loader are tested on it (its `language_model` is the reference), the drafter is not
WRAPPER_ONLY: list[str] = ["llama4_vl"]
ARCHS: list[str] = [
    *(a for a in _CONFIGS if a not in FALLBACK_ARCHS and a not in _TEXT_ONLY),
    *(w for w in WRAPPERS if w not in WRAPPER_ONLY),
]


def text_config(arch: str, num_layers: int | None = None) -> PretrainedConfig:
    """The (text) config `build_target(arch, ...)` uses for the decoder (default 3 layers, hybrids 4)."""
    arch = WRAPPERS.get(arch, arch)
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
    if arch in WRAPPERS:
        model = _wrapper(arch, text_config(arch, num_layers).to_dict())
    else:
        model = AutoModelForCausalLM.from_config(text_config(arch, num_layers), dtype=torch.float32)
    model.eval().save_pretrained(str(out_dir))
    build_tokenizer(out_dir)
    return out_dir


def _wrapper(arch: str, text: dict) -> torch.nn.Module:
    """The multimodal model class of `arch` around the text decoder `text`, with a one-layer vision tower."""
    qwen_vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        num_position_embeddings=16,
    )
    small_vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4
    )
    spare = VOCAB_SIZE - 4  # image tokens live in the spare rows of the embedding, as in real checkpoints
    if arch == "qwen3_5_vl":
        return Qwen3_5ForConditionalGeneration(
            Qwen3_5Config(text_config=text, vision_config=qwen_vision, tie_word_embeddings=False)
        )
    if arch == "qwen3_vl":
        return Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(
                text_config=text,
                vision_config={**qwen_vision, "deepstack_visual_indexes": [0]},
                image_token_id=spare,
                video_token_id=spare + 1,
                vision_start_token_id=spare + 2,
                vision_end_token_id=spare + 3,
                tie_word_embeddings=False,
            )
        )
    if arch == "qwen2_5_vl":
        return Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config=text,
                vision_config={**qwen_vision, "window_size": 16, "fullatt_block_indexes": [0]},
                image_token_id=spare,
                video_token_id=spare + 1,
                vision_start_token_id=spare + 2,
                vision_end_token_id=spare + 3,
            )
        )
    if arch == "llama4_vl":
        return Llama4ForConditionalGeneration(
            Llama4Config(
                text_config=text,
                vision_config=dict(
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    image_size=16,
                    patch_size=4,
                    vision_output_dim=32,
                    projector_input_dim=32,
                    projector_output_dim=64,
                    pixel_shuffle_ratio=0.5,
                ),
                image_token_index=spare,
                boi_token_index=spare + 1,
                eoi_token_index=spare + 2,
            )
        )
    if arch == "gemma3_vl":
        return Gemma3ForConditionalGeneration(
            Gemma3Config(
                text_config=text,
                vision_config=small_vision,
                mm_tokens_per_image=4,
                boi_token_index=spare,
                eoi_token_index=spare + 1,
                image_token_index=spare + 2,
                tie_word_embeddings=True,
            )
        )
    if arch == "mistral3_vl":
        return Mistral3ForConditionalGeneration(
            Mistral3Config(
                text_config=text,
                vision_config={**small_vision, "head_dim": 16},
                image_token_index=spare,
                spatial_merge_size=1,
                tie_word_embeddings=False,
            )
        )
    raise ValueError(f"no wrapper for {arch!r}")


def load_model(path: str | Path) -> torch.nn.Module:
    """The saved target as a user loads it: the class its config names (a multimodal wrapper as itself), fp32."""
    import json

    import transformers

    cls = getattr(transformers, json.loads((Path(path) / "config.json").read_text())["architectures"][0])
    return cls.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()


@torch.no_grad()
def layer_outputs(model: torch.nn.Module, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """The model's own `output_hidden_states` for one sequence `ids` [L]: the outputs of decoder layers
    `layer_ids` side by side [L, n·H], the last layer final-normed (as the producer captures them). Most models'
    tuple starts with the embedding; mamba's has none (layer i at index i) and ends with the normed last one."""
    hs = model(input_ids=ids[None], use_cache=False, output_hidden_states=True).hidden_states
    n = model.config.get_text_config().num_hidden_layers
    start = 0 if model.config.model_type in ("mamba", "mamba2", "falcon_mamba") else 1
    return torch.cat([hs[-1][0] if i == n - 1 else hs[start + i][0] for i in layer_ids], dim=-1)
