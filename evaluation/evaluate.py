"""Speculative decoding of a trained or published drafter against its target, and the single-drafter report.

CKPT is an export directory (config.json + model.safetensors, ours or z-lab's layout) or a checkpoint root
holding `latest`. `run_eval` decodes one's own chat records plainly and speculatively and reports τ (the
mean over responses of each response's mean acceptance length, dflash.md §4), its histogram, target
forwards per token and the wall-clock speedup; the command is evaluation/cli.py (dflash-eval).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from common.checkpoint_pointer import read_pointer
from consumer.dflash2 import DFlash2Drafter, DFlash2Proposer, DFlash2Shape
from consumer.dspark import DSPARK_ARCHITECTURE, DSparkDrafter, DSparkProposer, shape_from_export
from consumer.model import DFlashDrafter, DrafterArch
from consumer.sliding_rule import served_rule
from consumer.target_parts import load_target_parts
from evaluation.context_buckets import DEFAULT_EDGES, BucketTally, format_buckets
from evaluation.drafter_folder import EMBEDDING_KEYS, check_mask_token, check_state, load_weights, read_config
from evaluation.side_by_side import first_difference
from evaluation.speculative import Drafter, TargetRunner, greedy_generate, speculative_generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DFlashProposer:
    """The trained DFlash drafter behind the Drafter protocol: one forward drafts B-1 tokens."""

    def __init__(self, model: DFlashDrafter, block_size: int, mask_token_id: int, layer_ids: list[int]):
        self.model = model.eval()
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.layer_ids = list(layer_ids)

    def draft_logits(self, context_features: Tensor, tokens: Tensor) -> Tensor:
        block = tokens.new_full((self.block_size,), self.mask_token_id)
        block[0] = tokens[-1]
        feats = context_features.to(self.model.fc.weight.dtype)
        return self.model.draft(feats, block)[1:]  # [B-1, V]

    def propose(self, context_features: Tensor, tokens: Tensor) -> Tensor:
        return self.draft_logits(context_features, tokens).argmax(-1)  # [B-1]


def resolve_export_dir(path: str | Path) -> Path:
    """An export directory, or the one a checkpoint root's `latest` names."""
    path = Path(path)
    if (name := read_pointer(path)) is not None:
        path = path / name
    weights = ("model.safetensors", "model.safetensors.index.json")
    for names in (("config.json",), weights):
        if not any((path / name).is_file() for name in names):
            raise FileNotFoundError(f"drafter checkpoint {path}: no {names[0]} (expected a DFlash export directory)")
    return path


def load_drafter(
    ckpt: str | Path, target_path: str | Path, dtype: str = "float32", device: str = "cpu"
) -> DFlashProposer | DFlash2Proposer | DSparkProposer:
    """Build the drafter of an exported checkpoint on top of the target's frozen embedding and lm_head.
    The folder is checked first (evaluation/drafter_folder.py): a fault is one DrafterFolderError line."""
    path = resolve_export_dir(ckpt)
    cfg = read_config(path)
    archs = cfg.get("architectures") or ["DFlashDraftModel"]
    if archs == [DSPARK_ARCHITECTURE] and "dflash_config" not in cfg:  # DeepSpec's layout: the keys at the top level
        cfg = {**cfg, "dflash_config": {k: cfg[k] for k in ("mask_token_id", "target_layer_ids") if k in cfg}}
    if archs not in (["DFlashDraftModel"], ["DFlash2DraftModel"], [DSPARK_ARCHITECTURE]):
        raise ValueError(
            f"{path / 'config.json'}: architectures {archs}: only DFlashDraftModel, DFlash2DraftModel and"
            f" {DSPARK_ARCHITECTURE} drafters evaluate here"
        )
    try:
        dflash = cfg["dflash_config"]
        layer_ids = list(dflash["target_layer_ids"])
        mask_token_id = int(dflash["mask_token_id"])
        block_size = int(dflash.get("block_size", cfg.get("block_size", 16)))  # z-lab reads it there first
        rope = dict(cfg.get("rope_parameters") or {"rope_theta": cfg["rope_theta"], **(cfg.get("rope_scaling") or {})})
        theta = float(rope.pop("rope_theta"))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        arch = DrafterArch(
            hidden_size=int(cfg["hidden_size"]),
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg["num_key_value_heads"]),
            head_dim=int(cfg["head_dim"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_features=len(layer_ids),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=theta,
            rope_scaling=scaling,
            layer_types=tuple(cfg["layer_types"]) if cfg.get("layer_types") else None,
            sliding_window=cfg.get("sliding_window") if "sliding_attention" in (cfg.get("layer_types") or []) else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            sliding_block_attention=served_rule(cfg, str(path / "config.json")) or "causal",  # as engines serve it
        )
    except KeyError as err:
        raise KeyError(f"{path / 'config.json'}: required field {err.args[0]!r} is missing") from None
    parts = load_target_parts(target_path, DTYPES[dtype])
    if parts.hidden_size != arch.hidden_size or parts.vocab_size != int(cfg.get("vocab_size", parts.vocab_size)):
        raise ValueError(
            f"drafter {path} (hidden {arch.hidden_size}, vocab {cfg.get('vocab_size')}) does not fit the target"
            f" {target_path} (hidden {parts.hidden_size}, vocab {parts.vocab_size})"
        )
    check_mask_token(cfg, parts.vocab_size, path / "config.json", target_path)
    found, weights_file = load_weights(path)
    state = {k: v.to(DTYPES[dtype]) for k, v in found.items()}
    if archs == [DSPARK_ARCHITECTURE]:  # greedy evaluation: the Markov head's sequential walk (consumer/dspark.py)
        # DeepSpec saves its frozen copies of the target's embedding and head: the target's own are used
        state = {k: v for k, v in state.items() if k not in EMBEDDING_KEYS}
        model3 = DSparkDrafter(
            arch, shape_from_export(cfg, str(path / "config.json")), parts.embed_tokens, parts.lm_head
        )
        check_state(state, model3.state_dict(), weights_file, cfg)
        model3.load_state_dict(state, strict=True)
        return DSparkProposer(model3.to(device), mask_token_id, layer_ids)
    if archs == ["DFlash2DraftModel"]:  # greedy evaluation: the selector's walk (consumer/dflash2.py)
        try:
            shape = DFlash2Shape(
                block_size,
                *(int(dflash[k]) for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")),
                output_multiplier=float(dflash.get("output_multiplier", 1.0)),
                final_logit_softcapping=float(dflash["final_logit_softcapping"] or 0.0) or None
                if "final_logit_softcapping" in dflash
                else None,
                selector_vocab_size=dflash.get("selector_vocab_size"),
            )
        except KeyError as err:
            raise KeyError(f"{path / 'config.json'}: required field dflash_config.{err.args[0]} is missing") from None
        model2 = DFlash2Drafter(arch, shape, parts.embed_tokens, parts.lm_head)
        check_state(state, model2.state_dict(), weights_file, cfg)
        model2.load_state_dict(state, strict=True)
        return DFlash2Proposer(model2.to(device), mask_token_id, layer_ids)
    model = DFlashDrafter(arch, parts.embed_tokens, parts.lm_head)
    check_state(state, model.state_dict(), weights_file, cfg)
    model.load_state_dict(state, strict=True)
    return DFlashProposer(model.to(device), block_size, mask_token_id, layer_ids)


def load_target(path: str | Path, layer_ids: list[int], dtype: str = "float32", device: str = "cpu") -> TargetRunner:
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=DTYPES[dtype])
    return TargetRunner(model.to(device), layer_ids)


def load_prompts(path: str | Path, tokenizer: PreTrainedTokenizerBase, limit: int | None = None) -> list[list[int]]:
    """Prompt ids rendered with the chat template and the generation prompt."""
    prompts = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "messages" in rec:
                msgs = rec["messages"]
                while msgs and msgs[-1]["role"] == "assistant":
                    msgs = msgs[:-1]
            elif "prompt" in rec:
                msgs = [{"role": "user", "content": rec["prompt"]}]
            else:
                raise ValueError(f"{path}:{lineno}: a prompt record needs 'messages' or 'prompt'")
            if not msgs:
                raise ValueError(f"{path}:{lineno}: no user turn to answer")
            prompts.append(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False))
            if limit is not None and len(prompts) == limit:
                break
    return prompts


@dataclass
class EvalReport:
    block_size: int
    prompts: int
    generated_tokens: int
    tau: float  # mean over responses of each response's mean acceptance length
    tau_histogram: list[int]  # [k-1] = number of steps that accepted k tokens, k = 1..verify width (B; DSpark B+1)
    target_forwards_per_token: float  # speculative; plain greedy is 1.0
    plain_seconds: float
    speculative_seconds: float
    speedup: float  # time per output token, plain ÷ speculative
    lossless: bool
    mismatches: list[dict] = field(default_factory=list)  # {prompt, position, plain, speculative}
    # τ by context length (evaluation/context_buckets.py): {label, low, high, steps, accepted, tau} per bucket
    context_buckets: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate(
    target: TargetRunner,
    drafter: Drafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_id: int | None,
    warmup: bool = True,
    bucket_edges: Sequence[int] = DEFAULT_EDGES,
) -> EvalReport:
    """Plain and speculative greedy decoding of every prompt, interleaved so load changes hit both alike."""
    if not prompts:
        raise ValueError("evaluate: no prompts")
    device = next(target.model.parameters()).device
    ids = [torch.tensor(p, dtype=torch.long, device=device) for p in prompts]
    if warmup:  # first calls pay for allocator and kernel set-up; keep them out of the timings
        greedy_generate(target, ids[0], min(8, max_new_tokens), eos_token_id)
        speculative_generate(target, drafter, ids[0], min(8, max_new_tokens), eos_token_id)
    B = drafter.block_size
    hist = [0] * B
    buckets = BucketTally(bucket_edges)
    taus, mismatches = [], []
    plain_s = spec_s = 0.0
    tokens = forwards = 0
    for i, prompt in enumerate(ids):
        plain = greedy_generate(target, prompt, max_new_tokens, eos_token_id)
        spec = speculative_generate(target, drafter, prompt, max_new_tokens, eos_token_id)
        plain_s += plain.seconds
        spec_s += spec.seconds
        tokens += len(plain.tokens)
        forwards += spec.target_forwards
        for k in spec.accept_lengths:
            hist[k - 1] += 1
        buckets.add(spec.context_lengths, spec.accept_lengths)
        if spec.mean_accept is not None:
            taus.append(spec.mean_accept)
        pos = first_difference(plain.tokens, spec.tokens)
        if pos is not None:
            mismatches.append(
                {
                    "prompt": i,
                    "position": pos,
                    "plain": plain.tokens[pos : pos + 8],
                    "speculative": spec.tokens[pos : pos + 8],
                }
            )
    return EvalReport(
        block_size=getattr(drafter, "trained_block_size", B),  # DSpark: the trained block (B drafts, verify B+1)
        prompts=len(ids),
        generated_tokens=tokens,
        tau=sum(taus) / len(taus) if taus else 1.0,
        tau_histogram=hist,
        target_forwards_per_token=forwards / max(1, tokens),
        plain_seconds=plain_s,
        speculative_seconds=spec_s,
        speedup=plain_s / spec_s if spec_s > 0 else float("nan"),
        lossless=not mismatches,
        mismatches=mismatches,
        context_buckets=[asdict(b) for b in buckets.buckets()],
    )


def format_report(r: EvalReport, name: str = "drafter") -> str:
    peak = max(r.tau_histogram) or 1
    lines = [
        f"{name}: block {r.block_size}, {r.prompts} prompts, {r.generated_tokens} tokens",
        f"  tau (mean acceptance length)   {r.tau:.3f}",
        f"  target forwards per token      {r.target_forwards_per_token:.3f} (plain greedy: 1.000)",
        f"  wall clock: plain {r.plain_seconds:.2f}s, speculative {r.speculative_seconds:.2f}s,"
        f" speedup {r.speedup:.2f}x",
        f"  lossless                       {'yes' if r.lossless else f'NO: {len(r.mismatches)} mismatch(es)'}",
        f"  tau by context length (tokens) {format_buckets(r.context_buckets)}",
        "  acceptance length histogram:",
    ]
    lines += [f"    {k + 1:>3} {n:>6} {'#' * round(40 * n / peak)}" for k, n in enumerate(r.tau_histogram)]
    lines += [f"  mismatch: {m}" for m in r.mismatches[:5]]
    return "\n".join(lines)


def run_eval(
    target_path: str | Path,
    drafter_ckpt: str | Path,
    prompts_path: str | Path,
    *,
    limit: int | None = None,
    max_new_tokens: int = 128,
    dtype: str = "float32",
    device: str = "cpu",
    bucket_edges: Sequence[int] = DEFAULT_EDGES,
) -> EvalReport:
    """Load everything from disk and evaluate: what the CLI and the demo run."""
    drafter = load_drafter(drafter_ckpt, target_path, dtype, device)
    target = load_target(target_path, drafter.layer_ids, dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(str(target_path), local_files_only=True)
    prompts = load_prompts(prompts_path, tokenizer, limit)
    return evaluate(target, drafter, prompts, max_new_tokens, tokenizer.eos_token_id, bucket_edges=bucket_edges)
