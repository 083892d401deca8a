"""Regeneration: answers come from the target, the output resumes after a crash into the same file."""

import json

import pytest
import torch

from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl
from producer.data import DataError
from producer.regenerate import _generate, completed_lines, main, regenerate


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("regen")
    chats = list(synthetic_chats(9, seed=11))
    tok = train_tokenizer(corpus_texts(synthetic_chats(60)), 500, root / "tok")
    model_dir = build_tiny_target(root / "model", tok, num_layers=2, hidden_size=32, intermediate_size=64)
    lines = [json.dumps(c) for c in chats]
    lines.insert(3, "{broken")
    lines.insert(5, json.dumps({"messages": [{"role": "user", "content": "no answer yet"}]}))
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    return model_dir, prompts, chats


def run(setup, out, **kw):
    model_dir, prompts, _ = setup
    args = dict(batch_size=4, max_new_tokens=6, dtype="float32")
    args.update(kw)
    return regenerate(model_dir, prompts, out, **args)


def test_output_replaces_the_last_answer(setup, tmp_path):
    chats = setup[2]
    stats = run(setup, tmp_path / "out.jsonl")
    assert stats.prompts == stats.written == 10 and stats.already_done == 0
    records = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["prompt_line"] for r in records] == [1, 2, 3, 5, 6, 7, 8, 9, 10, 11]
    assert records[0]["messages"][:-1] == chats[0]["messages"][:-1]
    assert records[0]["messages"][-1]["role"] == "assistant"
    assert records[0]["messages"][-1]["content"] != chats[0]["messages"][-1]["content"]
    assert records[4]["messages"][:-1] == [{"role": "user", "content": "no answer yet"}]
    assert all(r["finish"] in ("stop", "length") for r in records)


@pytest.mark.parametrize("cut", ["mid_line", "line_boundary", "mid_batch"])
def test_resume_after_interruption_gives_the_same_file(setup, tmp_path, cut):
    whole = tmp_path / "whole.jsonl"
    run(setup, whole)
    data = whole.read_bytes()
    ends = [i + 1 for i, b in enumerate(data) if b == ord("\n")]
    keep = {"mid_line": ends[5] + 7, "line_boundary": ends[3], "mid_batch": ends[1] + 3}[cut]
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_bytes(data[:keep])
    stats = run(setup, resumed)
    assert resumed.read_bytes() == data
    assert stats.already_done + stats.written == 10


def test_sampling_is_seeded(setup, tmp_path):
    a = run(setup, tmp_path / "a.jsonl", temperature=1.0, top_p=0.9, seed=3)
    run(setup, tmp_path / "b.jsonl", temperature=1.0, top_p=0.9, seed=3)
    assert a.written == 10
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()


def test_answers_stop_at_the_first_eos():
    class Tok:
        eos_token_id = 7

        def apply_chat_template(self, c, tokenize, add_generation_prompt, **kwargs):
            return "p"

        def __call__(self, texts, **kw):
            class Enc(dict):
                def to(self, device):
                    return self

            return Enc(input_ids=torch.zeros(len(texts), 2, dtype=torch.long))

        def decode(self, tokens, skip_special_tokens):
            return " ".join(str(t) for t in tokens if not (skip_special_tokens and t == 7))

    class Model:
        device = "cpu"

        def generate(self, **kw):
            return torch.tensor([[0, 0, 5, 7, 9, 7], [0, 0, 5, 6, 4, 3]])

    answers = _generate(Tok(), Model(), [[], []], None, {7}, {})
    assert answers == [("5", 2, "stop"), ("5 6 4 3", 4, "length")]


def test_bad_inputs(setup, tmp_path):
    model_dir, prompts, _ = setup
    with pytest.raises(DataError, match="does not exist"):
        regenerate(model_dir, tmp_path / "none.jsonl", tmp_path / "o.jsonl")
    foreign = write_jsonl(tmp_path / "foreign.jsonl", [{"messages": []}])
    with pytest.raises(DataError, match="not a regenerated record"):
        completed_lines(foreign)
    assert main(["--target", str(tmp_path / "nomodel"), "--prompts", str(prompts), "--out", str(tmp_path / "o")]) == 2


def test_the_default_attention_is_the_models_own_choice(tmp_path, capsys):
    """Issue 21 item 4: gemma2 has no sdpa (its attention soft-capping is eager's); `regenerate --target` picks
    what the model supports, as the producer does, instead of crashing on a hard-coded sdpa."""
    import transformers

    from tests.target_zoo import build_tokenizer

    config = transformers.Gemma2Config(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        attn_logit_softcapping=50.0,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
    )
    assert not transformers.Gemma2ForCausalLM._supports_sdpa
    transformers.Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    build_tokenizer(tmp_path / "gemma2")
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, list(synthetic_chats(2, seed=3)))
    out = tmp_path / "out.jsonl"
    argv = [
        "--target",
        str(tmp_path / "gemma2"),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--max-new-tokens",
        "3",
        "--dtype",
        "float32",
    ]
    assert main(argv) == 0
    assert len(out.read_text().splitlines()) == 2
    assert main([*argv, "--attn-implementation", "sdpa"]) == 2  # named: a clear line, no traceback
    assert "Gemma2ForCausalLM does not support attn_implementation 'sdpa'" in capsys.readouterr().err
