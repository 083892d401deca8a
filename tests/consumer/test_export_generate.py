"""The exported drafter serves the way z-lab's README shows: AutoModel + trust_remote_code, then
spec_generate with a transformers target; lossless against the target's own greedy decoding, with a
draft KV cache that gives the same drafts as recomputing the whole context."""

from __future__ import annotations

import pytest
import torch
import transformers

from consumer.export.layout import export_config, write_export
from consumer.model import DFlashDrafter, DrafterArch
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from tests.consumer.test_drafter_common import LAYER_IDS, drafter_cfg, target_features, tiny_target

B = 4
EOS = 3


def load_export(path):
    model = transformers.AutoModel.from_pretrained(
        str(path), trust_remote_code=True, local_files_only=True, dtype=torch.float32
    )
    assert type(model).__name__ == "DFlashDraftModel"
    return model


def export(trainer_or_model, parts, path, arch, mask_token_id):
    cfg = export_config(
        arch, parts, block_size=B, mask_token_id=mask_token_id, target_layer_ids=LAYER_IDS, dtype="float32"
    )
    write_export(path, trainer_or_model.state_dict(), cfg)
    return load_export(path)


@torch.no_grad()
def plain_greedy(target, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """The target alone, transformers' own generate (greedy, stopping at EOS)."""
    out = target.generate(
        prompt[None], max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=0
    )
    return out[0].tolist()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target and a drafter trained on the target's own greedy continuations of 3 prompts (as the
    paper regenerates its data), so drafts are often accepted and every branch of the loop runs."""
    path = tmp_path_factory.mktemp("target")
    target = tiny_target(path)
    prompts = [torch.tensor([5 + i, 40 + 7 * i, 90 + i, 200 + 3 * i]) for i in range(3)]
    seqs = [torch.tensor(plain_greedy(target, p, 40)) for p in prompts]
    ids = torch.cat(seqs)
    mask = torch.cat([(torch.arange(len(s)) >= 4).to(torch.uint8) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    parts = load_target_parts(path)
    trainer = Trainer(drafter_cfg(block_size=B, num_layers=2, anchors_per_seq=24), parts, LAYER_IDS, "cpu")
    feats = target_features(target, seqs)
    for i in range(80):
        trainer.train_batch(feats, ids, mask, cu, seq=i)
    model = export(trainer.model, parts, tmp_path_factory.mktemp("export"), trainer.arch, trainer.mask_token_id)
    return target, trainer, model, prompts


def test_spec_generate_is_lossless_and_accepts_drafts(trained):
    target, _, draft, prompts = trained
    taus, steps = [], []
    for prompt in [*prompts, torch.tensor([300, 301, 17])]:  # the last one unseen in training
        out = draft.spec_generate(
            input_ids=prompt[None], max_new_tokens=40, temperature=0.0, target=target, stop_token_ids=[EOS]
        )
        assert out[0].tolist() == plain_greedy(target, prompt, 40)
        new = out.shape[1] - len(prompt)  # the prefill commits the first token, each step a+1 more
        assert 1 + sum(draft.acceptance_lengths) >= new > sum(draft.acceptance_lengths) - B
        assert all(1 <= a <= B for a in draft.acceptance_lengths)
        taus.append(sum(draft.acceptance_lengths) / len(draft.acceptance_lengths))
        steps += draft.acceptance_lengths
    assert min(taus[:3]) > 2.0, taus  # trained on these continuations: most drafts accepted
    assert 1 in steps and B in steps  # both the rollback and the all-accepted branch ran


def test_spec_generate_stops_at_a_stop_token_and_the_length_limit(trained):
    target, _, draft, prompts = trained
    full = plain_greedy(target, prompts[0], 40)[len(prompts[0]) :]
    stop = full[5]
    out = draft.spec_generate(input_ids=prompts[0][None], max_new_tokens=40, target=target, stop_token_ids=[stop])
    new = out[0, len(prompts[0]) :].tolist()
    assert new == full[: full.index(stop) + 1]
    out = draft.spec_generate(input_ids=prompts[0][None], max_new_tokens=7, target=target, stop_token_ids=[])
    assert out[0, len(prompts[0]) :].tolist() == full[:7]
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        draft.spec_generate(input_ids=prompts[0][None], max_new_tokens=4, target=target, temperature=-0.5)


def _stop_inside_a_step(free: list[int], steps: list[int]) -> tuple[int, int] | None:
    """(index in free, step) of a token committed strictly inside a step of >= 3 tokens (neither the step's
    first nor its last) that occurs nowhere before it: a stop there ends decoding mid-block."""
    start = 1  # free[0] is the prefill's token; step k commits free[start : start + steps[k]]
    for k, n in enumerate(steps):
        for i in range(start + 1, start + n - 1):
            if i < len(free) and free[i] not in free[:i]:
                return i, k
        start += n
    return None


@pytest.mark.parametrize("temperature", [0.0, 1e-6], ids=["greedy", "sampling-path"])
def test_spec_generate_stops_at_a_stop_token_inside_an_accepted_block(trained, temperature):
    """Issue 22: a stop token committed inside a step (not its last token) must end decoding at that step:
    the tokens end at the stop, and acceptance_lengths are the free run's steps up to and including the one
    that committed it, on the greedy and on the speculative-sampling path (1e-6: one-hot p and q, so the
    blocks are long enough to hold a stop inside; same seed, same draws up to there). Checking only the
    last committed token decoded on to max_new_tokens and deflated τ with the extra steps."""
    target, _, draft, prompts = trained
    cases = 0
    for prompt in prompts:
        torch.manual_seed(11)
        out = draft.spec_generate(
            input_ids=prompt[None], max_new_tokens=40, target=target, stop_token_ids=[], temperature=temperature
        )
        free, steps = out[0, len(prompt) :].tolist(), list(draft.acceptance_lengths)
        hit = _stop_inside_a_step(free, steps)
        if hit is None:
            continue
        i, k = hit
        torch.manual_seed(11)
        out = draft.spec_generate(
            input_ids=prompt[None], max_new_tokens=40, target=target, stop_token_ids=[free[i]], temperature=temperature
        )
        assert out[0, len(prompt) :].tolist() == free[: i + 1]
        assert draft.acceptance_lengths == steps[: k + 1], (draft.acceptance_lengths, steps, i, k)
        assert len(steps) > k + 1  # the free run went on past that step: the old loop would have too
        cases += 1
    assert cases >= 1, "no prompt committed a fresh token strictly inside a step of >= 3"


def test_spec_generate_samples_and_is_greedy_at_a_vanishing_temperature(trained):
    """One-hot p and q (temperature 1e-6) make speculative sampling greedy verification: same tokens and the
    same acceptance per step, which pins the slot alignment of p, q and the drafts."""
    target, _, draft, prompts = trained
    greedy = draft.spec_generate(input_ids=prompts[1][None], max_new_tokens=30, target=target, stop_token_ids=[EOS])
    greedy_steps = list(draft.acceptance_lengths)
    cold = draft.spec_generate(
        input_ids=prompts[1][None], max_new_tokens=30, target=target, stop_token_ids=[EOS], temperature=1e-6
    )
    assert cold.tolist() == greedy.tolist() and draft.acceptance_lengths == greedy_steps
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(
            draft.spec_generate(
                input_ids=prompts[1][None], max_new_tokens=30, target=target, stop_token_ids=[], temperature=1.5
            )[0].tolist()
        )
        assert all(1 <= a <= B for a in draft.acceptance_lengths)
    assert runs[0] == runs[1] and len(runs[0]) == len(prompts[1]) + 30  # seeded: repeatable, no early stop
    assert runs[0] != greedy[0].tolist()[: len(runs[0])]  # and it does sample


def test_speculative_accept_commits_the_targets_distribution():
    """Literal p (target) and q (drafter) that differ a lot: without the rejection rule the committed tokens
    would follow q. 20,000 blocks of K = 2 drafts; slot 0, slot 1 given slot 0 kept, and the bonus token after
    a fully kept block must each follow p (total variation < 0.02; q is 0.3+ away)."""
    from consumer.export.dflash import speculative_accept

    p = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.1, 0.1, 0.2, 0.6], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.7, 0.1, 0.1, 0.1]])
    torch.manual_seed(0)
    slot0, slot1, bonus = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    for _ in range(20_000):
        drafts = torch.multinomial(q, 1)[:, 0]
        a, nxt = speculative_accept(p, q, drafts)
        committed = [*drafts[:a].tolist(), nxt]
        slot0[committed[0]] += 1
        if a >= 1:
            slot1[committed[1]] += 1
        if a == 2:
            bonus[committed[2]] += 1
    for seen, want in ((slot0, p[0]), (slot1, p[1]), (bonus, p[2])):
        assert seen.sum() > 500
        assert 0.5 * (seen / seen.sum() - want).abs().sum() < 0.02, (seen / seen.sum(), want)
    assert 0.5 * (p[0] - q[0]).abs().sum() > 0.3 and 0.5 * (p[1] - q[1]).abs().sum() > 0.3


def test_draft_kv_cache_gives_the_uncached_drafts(trained):
    """Feeding only the new context rows with a cache == feeding the whole context without one."""
    target, trainer, draft, prompts = trained
    seq = torch.tensor(plain_greedy(target, prompts[1], 30))
    feats = target_features(target, [seq])  # [S, n·H]
    embed = trainer.parts.embed_tokens
    cache = transformers.DynamicCache(config=draft.config)
    done = 0
    for p in (6, 9, 10, 17):  # anchors after 6, 3, 1 and 7 newly accepted positions
        block = torch.tensor([int(seq[p])] + [trainer.mask_token_id] * (B - 1))
        noise = embed[block][None]
        pos = torch.arange(done, p + B)[None]
        with torch.no_grad():
            cached = draft(noise, feats[None, done:p], pos, past_key_values=cache, use_cache=True)
            uncached = draft(noise_embedding=noise, target_hidden=feats[None, :p])
        assert cache.get_seq_length() == p  # context rows only: the block is never cached
        torch.testing.assert_close(cached, uncached, rtol=1e-5, atol=1e-5)
        want = trainer.model.draft(feats[:p], block)  # and both are the training model's drafting
        torch.testing.assert_close(uncached[0] @ trainer.parts.lm_head.T, want, rtol=1e-4, atol=1e-4)
        done = p


@pytest.mark.parametrize(
    "options",
    [
        dict(layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=5),
        dict(rope_theta=1e7, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
        dict(
            rope_theta=5e5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ],
    ids=["sliding", "yarn", "llama3"],
)
def test_export_matches_the_training_model_with_windows_and_rope_scaling(trained, tmp_path, options):
    """Windows and RoPE scaling are computed independently on both sides (objective/model vs the export,
    which uses transformers' Qwen3RotaryEmbedding); their drafts agree, cached or not, and with a window
    shorter than the context the sliding layers do change the result."""
    target, trainer, _, prompts = trained
    parts = trainer.parts
    arch = DrafterArch(
        64,
        4,
        2,
        16,
        128,
        3,
        len(LAYER_IDS),
        1e-6,
        options.pop("rope_theta", 1e6),
        max_position_embeddings=256,
        **options,
    )
    model = DFlashDrafter(arch, parts.embed_tokens, parts.lm_head, init_seed=3)
    draft = export(model, parts, tmp_path, arch, 511)
    seq = torch.tensor(plain_greedy(target, prompts[2], 40))
    feats = target_features(target, [seq])
    cache = transformers.DynamicCache(config=draft.config)
    done = 0
    for p in (12, 20, 33):
        block = torch.tensor([int(seq[p])] + [511] * (B - 1))
        want = model.draft(feats[:p], block)
        with torch.no_grad():
            got = draft(noise_embedding=parts.embed_tokens[block][None], target_hidden=feats[None, :p])
            cached = draft(
                parts.embed_tokens[block][None],
                feats[None, done:p],
                torch.arange(done, p + B)[None],
                past_key_values=cache,
                use_cache=True,
            )
        torch.testing.assert_close(got[0] @ parts.lm_head.T, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cached, got, rtol=1e-5, atol=1e-5)
        done = p
    out = draft.spec_generate(input_ids=prompts[2][None], max_new_tokens=30, target=target, stop_token_ids=[EOS])
    assert out[0].tolist() == plain_greedy(target, prompts[2], 30)


def test_export_config_keys_for_windows_rope_and_special_tokens(trained):
    _, trainer, _, _ = trained
    parts = trainer.parts
    arch = DrafterArch(
        64,
        4,
        2,
        16,
        128,
        3,
        3,
        1e-6,
        1e7,
        layer_types=("full_attention", "sliding_attention", "sliding_attention"),
        sliding_window=2048,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    cfg = export_config(arch, parts, block_size=B, mask_token_id=7, target_layer_ids=LAYER_IDS, dtype="bfloat16")
    assert cfg["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert (cfg["sliding_window"], cfg["use_sliding_window"], cfg["max_window_layers"]) == (2048, True, 1)
    assert "is_causal" not in cfg and cfg["rope_theta"] == 1e7  # causal sliding blocks: engines infer it
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert cfg["rope_parameters"] == {**cfg["rope_scaling"], "rope_theta": 1e7}
    assert "bos_token_id" not in cfg and "eos_token_id" not in cfg  # the tiny target declares none
    plain = export_config(
        trainer.arch, parts, block_size=B, mask_token_id=7, target_layer_ids=LAYER_IDS, dtype="bfloat16"
    )
    assert plain["layer_types"] == ["full_attention"] * 2 and plain["rope_scaling"] is None
    assert (plain["sliding_window"], plain["use_sliding_window"], plain["max_window_layers"]) == (None, False, 2)


def test_export_config_takes_the_targets_bos_and_eos(tmp_path):
    """From config.json, and the generation config's stop list over it (what generate() stops at)."""
    tiny_target(tmp_path / "t", bos_token_id=5, eos_token_id=EOS)
    parts = load_target_parts(tmp_path / "t")
    arch = DrafterArch(64, 4, 2, 16, 128, 1, 3, 1e-6, 1e6)
    kw = dict(block_size=B, mask_token_id=7, target_layer_ids=LAYER_IDS, dtype="float32")
    cfg = export_config(arch, parts, **kw)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (5, EOS)
    transformers.GenerationConfig(bos_token_id=5, eos_token_id=[EOS, 9]).save_pretrained(tmp_path / "t")
    assert export_config(arch, parts, **kw)["eos_token_id"] == [EOS, 9]
    (tmp_path / "e").mkdir()
    draft = export(DFlashDrafter(arch, parts.embed_tokens, parts.lm_head), parts, tmp_path / "e", arch, 7)
    assert draft.config.eos_token_id == [EOS, 9]  # spec_generate's default stop tokens
