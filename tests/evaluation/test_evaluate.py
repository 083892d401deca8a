"""Speculative decoding: lossless against plain greedy, τ exact on scripted drafters, the CLI end to end."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from consumer.model import DFlashDrafter, DrafterArch
from evaluation.cli import main
from evaluation.evaluate import DFlashProposer, evaluate
from evaluation.speculative import Generation, TargetRunner, greedy_generate, speculative_generate

VOCAB = 256
LAYER_IDS = [1, 3]


@pytest.fixture(scope="module")
def target() -> TargetRunner:
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # a sharper random model: fewer near-ties between the top two logits
        model.lm_head.weight.mul_(8.0)
    return TargetRunner(model, LAYER_IDS)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 7, 12, 20)]


class ScriptedDrafter:
    """Knows the target's own greedy continuation; right for the first `right(tokens)` slots, then wrong."""

    def __init__(self, target: TargetRunner, block_size: int, right=lambda tokens: 10**9):
        self.target, self.block_size, self.right = target, block_size, right
        self.calls = 0

    def propose(self, context_features, tokens):
        self.calls += 1
        assert context_features.shape == (tokens.shape[0] - 1, len(LAYER_IDS) * 64)
        oracle = torch.tensor(greedy_generate(self.target, tokens, self.block_size - 1, None).tokens)
        k = min(self.right(tokens), self.block_size - 1)
        oracle[k:] = (oracle[k:] + 1) % VOCAB  # a wrong token in every slot from k on
        return oracle


def random_dflash(target: TargetRunner, block_size: int) -> DFlashProposer:
    cfg = target.model.config
    arch = DrafterArch(
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_layers=2,
        num_features=len(LAYER_IDS),
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=10000.0,
    )
    model = DFlashDrafter(arch, target.model.model.embed_tokens.weight, target.model.lm_head.weight, init_seed=3)
    return DFlashProposer(model, block_size, mask_token_id=VOCAB - 1, layer_ids=LAYER_IDS)


def test_features_are_hf_hidden_states_including_the_normed_last_layer(target, prompts):
    runner = TargetRunner(target.model, [0, 2, 3])  # 3 is the last layer: HF reports it final-normed
    ids = torch.tensor(prompts[3])
    _, feats = runner.forward(ids, runner.new_cache(), capture=True)
    with torch.no_grad():
        hs = target.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    assert torch.allclose(feats, torch.cat([hs[i + 1][0] for i in (0, 2, 3)], -1), atol=1e-5)
    cache = runner.new_cache()  # incremental with a cache: the same rows
    _, head = runner.forward(ids[:5], cache, capture=True)
    _, tail = runner.forward(ids[5:], cache, capture=True)
    assert torch.allclose(torch.cat([head, tail]), feats, atol=1e-5)


@pytest.mark.parametrize("block_size", [4, 8])
def test_random_dflash_drafter_is_lossless(target, prompts, block_size):
    report = evaluate(target, random_dflash(target, block_size), prompts, max_new_tokens=24, eos_token_id=None)
    assert report.lossless, report.mismatches
    assert report.generated_tokens == 24 * len(prompts)
    assert sum(report.tau_histogram) > 0 and 1.0 <= report.tau <= block_size


def test_oracle_drafter_accepts_every_full_block(target, prompts):
    B, max_new = 8, 33  # prefill gives token 1, then 4 steps of 8
    drafter = ScriptedDrafter(target, B)
    report = evaluate(target, drafter, prompts, max_new_tokens=max_new, eos_token_id=None, warmup=False)
    assert report.lossless, report.mismatches
    assert report.tau == B
    assert report.tau_histogram == [0] * (B - 1) + [4 * len(prompts)]
    assert report.target_forwards_per_token == pytest.approx(5 / max_new)


def test_always_wrong_drafter_gives_tau_one(target, prompts):
    report = evaluate(target, ScriptedDrafter(target, 8, right=lambda t: 0), prompts, 10, None, warmup=False)
    assert report.lossless
    assert report.tau == 1.0
    assert report.tau_histogram == [9 * len(prompts)] + [0] * 7  # one token per step after the prefill's
    assert report.target_forwards_per_token == 1.0


def test_tau_is_mean_over_responses_of_each_mean(target, prompts):
    # right for 5 slots on the last prompt (steps of 6), for 2 on the others (steps of 3): each
    # response's mean is exactly 6 or 3 whatever its number of steps (the 30th token cuts a step short)
    right = lambda tokens: 5 if int(tokens[0]) == prompts[2][0] else 2  # noqa: E731
    report = evaluate(target, ScriptedDrafter(target, 8, right), prompts[:3], 30, None, warmup=False)
    assert report.lossless
    assert report.tau == pytest.approx((3 + 3 + 6) / 3)
    assert report.tau_histogram[2] == 2 * 10 and report.tau_histogram[5] == 5  # 29 tokens after the prefill
    assert set(k + 1 for k, n in enumerate(report.tau_histogram) if n) <= {3, 6}


def test_stops_at_eos_like_plain_greedy(target, prompts):
    prompt = torch.tensor(prompts[1])
    free = greedy_generate(target, prompt, 40, None).tokens
    eos = free[13]  # a token the target emits; both decoders must stop at its first occurrence
    plain = greedy_generate(target, prompt, 40, eos)
    spec = speculative_generate(target, ScriptedDrafter(target, 8), prompt, 40, eos)
    assert plain.tokens == spec.tokens == free[: free.index(eos) + 1]
    # prefill: token 0; each step of 8 commits tokens 8k+1..8k+8: the step holding the stop is the last
    first = free.index(eos)
    assert first > 0 and spec.accept_lengths == [8] * -(-first // 8)
    stops = [free[30], free[3]]  # several stop ids: the earliest occurrence of any ends it
    first = min(free.index(t) for t in stops)
    spec = speculative_generate(target, ScriptedDrafter(target, 8), prompt, 40, stops)
    assert spec.tokens == free[: first + 1] and spec.accept_lengths == [8] * -(-first // 8)


def test_sampling_path_at_a_vanishing_temperature_is_greedy(target, prompts):
    """Temperature 1e-6 makes p and q one-hot: speculative sampling then keeps exactly the greedy prefix,
    which pins the alignment of the target's and the drafter's slots in the sampling path."""
    drafter = random_dflash(target, 4)
    for p in prompts[:2]:
        prompt = torch.tensor(p)
        greedy = speculative_generate(target, drafter, prompt, 20, None)
        cold = speculative_generate(target, drafter, prompt, 20, None, temperature=1e-6)
        assert (cold.tokens, cold.accept_lengths) == (greedy.tokens, greedy.accept_lengths)
        assert greedy_generate(target, prompt, 20, None, temperature=1e-6).tokens == greedy.tokens
    with pytest.raises(ValueError, match="needs a drafter with draft_logits"):
        speculative_generate(target, ScriptedDrafter(target, 4), torch.tensor(prompts[0]), 5, None, temperature=1.0)


def test_a_mismatch_is_reported(target, prompts, monkeypatch):
    import evaluation.evaluate as ev

    def corrupted(*args, **kwargs):
        g = speculative_generate(*args, **kwargs)
        return Generation(
            [*g.tokens[:5], (g.tokens[5] + 1) % VOCAB, *g.tokens[6:]],
            g.target_forwards,
            g.seconds,
            g.accept_lengths,
            g.context_lengths,
        )

    monkeypatch.setattr(ev, "speculative_generate", corrupted)
    report = evaluate(target, random_dflash(target, 4), prompts[:1], 12, None, warmup=False)
    assert not report.lossless
    assert report.mismatches[0]["prompt"] == 0 and report.mismatches[0]["position"] == 5


def test_cli_on_saved_target_and_exported_drafter(tmp_path, capsys):
    from consumer.export.layout import export_config, write_export
    from consumer.target_parts import load_target_parts
    from demo.tiny import build_tiny_target, train_tokenizer

    texts = [f"count {i} {i + 1} {i + 2} and say hello world" for i in range(200)]
    tok = train_tokenizer(texts, 300, tmp_path / "tok")
    target_dir = build_tiny_target(tmp_path / "target", tok, hidden_size=64, num_layers=4, seed=0)
    parts = load_target_parts(target_dir)
    runner = TargetRunner(AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True), LAYER_IDS)
    proposer = random_dflash(runner, 4)
    export = tmp_path / "ckpt" / "step_7"
    export.mkdir(parents=True)
    cfg = export_config(
        proposer.model.arch,
        parts,
        block_size=4,
        mask_token_id=tok.mask_token_id,
        target_layer_ids=LAYER_IDS,
        dtype="float32",
    )
    write_export(export, proposer.model.state_dict(), cfg)
    (tmp_path / "ckpt" / "latest").write_text("step_7\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "messages": [
                        {"role": "user", "content": "count 3 4"},
                        {"role": "assistant", "content": "5"},
                    ]
                },
                {"prompt": "say hello"},
            ]
        )
        + "\n"
    )
    rc = main(
        [
            "--target",
            str(target_dir),
            "--drafter",
            str(tmp_path / "ckpt"),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--threads",
            "1",
            "--context-buckets",
            "8,16",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert out["lossless"] and out["prompts"] == 2 and out["block_size"] == 4
    assert 1.0 <= out["tau"] <= 4 and sum(out["tau_histogram"]) > 0
    buckets = out["context_buckets"]  # every step in one bucket, its tokens counted once
    assert [b["label"] for b in buckets] == ["<8", "8–16", "≥16"]
    assert sum(b["steps"] for b in buckets) == sum(out["tau_histogram"])
    assert sum(b["accepted"] for b in buckets) == sum((k + 1) * n for k, n in enumerate(out["tau_histogram"]))


@pytest.mark.parametrize("edges", ["16,8", "0,8", "8,x"])
def test_cli_refuses_bad_context_bucket_edges(tmp_path, capsys, edges):
    rc = main(
        ["--target", str(tmp_path), "--drafter", str(tmp_path), "--prompts", "p.jsonl", "--context-buckets", edges]
    )
    assert rc == 2
    assert capsys.readouterr().err.startswith(f"dflash-eval: --context-buckets {edges}: ")


def test_tau_by_context_length_counts_each_step_where_it_drafts(target, prompts):
    """Right for every slot while fewer than 20 tokens are committed, then for 2: on the 3-token prompt the
    steps draft at 4 and 12 tokens (8 accepted each), then at 20, 23, ..., 35 (3 each) until 33 are made."""
    right = lambda tokens: 7 if len(tokens) < 20 else 2  # noqa: E731
    spec = speculative_generate(target, ScriptedDrafter(target, 8, right), torch.tensor(prompts[0]), 33, None)
    assert spec.context_lengths == [4, 12, 20, 23, 26, 29, 32, 35]
    assert spec.accept_lengths == [8, 8, 3, 3, 3, 3, 3, 3]
    report = evaluate(
        target, ScriptedDrafter(target, 8, right), prompts[:1], 33, None, warmup=False, bucket_edges=(10, 20)
    )
    by = {b["label"]: (b["steps"], b["accepted"], b["tau"]) for b in report.context_buckets}
    assert by == {"<10": (1, 8, 8.0), "10–20": (1, 8, 8.0), "≥20": (6, 18, 3.0)}
    assert report.tau == pytest.approx(34 / 8)  # the response's own mean: all its steps together


@pytest.mark.parametrize("arch", ["qwen3_5_vl", "gpt_oss"])
def test_hybrid_wrapper_and_sink_targets_with_a_sliding_drafter(tmp_path, arch):
    """dflash-eval on the Qwen3.6-27B form (multimodal wrapper, Gated DeltaNet layers rolled back by `crop` on
    transformers 5.25, from a copy on 5.24) and gpt-oss (sliding layers, sinks), with a drafter that has sliding
    layers and yarn RoPE: lossless, and load_drafter rebuilds the drafter the export describes (its drafts
    equal the AutoModel export's)."""
    import transformers

    from consumer.export.layout import export_config, write_export
    from consumer.target_parts import load_target_parts
    from evaluation.evaluate import load_drafter, load_target
    from tests.target_zoo import build_target

    path = build_target(arch, tmp_path / "target")
    parts = load_target_parts(path)
    arch_ = DrafterArch(
        64,
        4,
        2,
        16,
        128,
        2,
        2,
        1e-6,
        1e7,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=6,
        max_position_embeddings=parts.max_position_embeddings,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": parts.max_position_embeddings // 4,
        },
    )
    model = DFlashDrafter(arch_, parts.embed_tokens, parts.lm_head, init_seed=1)
    cfg = export_config(arch_, parts, block_size=4, mask_token_id=3, target_layer_ids=[0, 2], dtype="float32")
    write_export(tmp_path, model.state_dict(), cfg)
    proposer = load_drafter(tmp_path, path)
    assert proposer.model.arch == arch_
    runner = load_target(path, [0, 2])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 260, (n,), generator=g).tolist() for n in (5, 11)]
    report = evaluate(runner, proposer, prompts, max_new_tokens=10, eos_token_id=None, warmup=False)
    assert report.lossless, report.mismatches
    feats = runner.forward(torch.tensor(prompts[1]), runner.new_cache(), capture=True)[1]
    block = torch.tensor([prompts[1][-1], 3, 3, 3])
    export = transformers.AutoModel.from_pretrained(str(tmp_path), trust_remote_code=True, local_files_only=True)
    with torch.no_grad():
        h = export(noise_embedding=parts.embed_tokens[block][None], target_hidden=feats[None, :10])
    torch.testing.assert_close(h[0] @ parts.lm_head.T, proposer.model.draft(feats[:10], block), rtol=1e-4, atol=1e-4)
