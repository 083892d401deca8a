"""The local HF assets: a trained tokenizer with its chat template, a random target saved like a download."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl


@pytest.mark.parametrize("template,eot", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_tokenizer_and_target_reload_from_disk(tmp_path, template, eot):
    records = list(synthetic_chats(50, seed=1))
    tok = train_tokenizer(corpus_texts(records), 600, tmp_path / "tok", template=template)
    model_dir = build_tiny_target(tmp_path / "model", tok, num_layers=3)

    again = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert len(again) == len(tok)
    assert again.eos_token == eot and again.pad_token == "<|endoftext|>" and again.mask_token == "<|MASK|>"
    msgs = records[0]["messages"]
    text = again.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.count(eot) == len(msgs)
    assert msgs[-1]["content"] in text

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert cfg.vocab_size == len(tok) and cfg.num_hidden_layers == 3
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    ids = again.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert model(torch.tensor([ids])).logits.shape == (1, len(ids), len(tok))


def test_unknown_template_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="unknown chat template 'nope'"):
        train_tokenizer(["a b c"], 300, tmp_path, template="nope")


def test_synthetic_chats_are_deterministic(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", synthetic_chats(10, seed=3)).read_text()
    b = write_jsonl(tmp_path / "b.jsonl", synthetic_chats(10, seed=3)).read_text()
    assert a == b
    rec = json.loads(a.splitlines()[0])
    assert rec["messages"][-1]["role"] == "assistant"
