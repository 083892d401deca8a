"""Thinking-mode chat templates: the loss mask covers exactly what the target emits as the assistant.

The template is our own, in the style of the Qwen3 family: a `<think>` block on assistant turns after the
last user message (from `reasoning_content` or inline in the content), history turns stripped of their
reasoning, and an `enable_thinking` switch whose `false` pre-fills an empty think block in the generation
prompt (so the model does not emit it and it gets no loss).
"""

import json

import pytest

from bench.harness import write_job
from common.config import load_job
from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl
from producer.build import build_dataset
from producer.data import ChatEncoder

QWEN3_STYLE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none -%}"
    "{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n')"
    " + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

U1 = {"role": "user", "content": "What is two plus two?"}
A1 = {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two make four."}
U2 = {"role": "user", "content": "And three plus three?"}
A2 = {"role": "assistant", "content": "Six.", "reasoning_content": "Three and three make six."}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [*corpus_texts(synthetic_chats(60, seed=5)), "What is two plus two? Four. Three and three make six."]
    tok = train_tokenizer(texts, 600, tmp_path_factory.mktemp("think"), template="chatml")
    tok.add_tokens(["<think>", "</think>"])  # added, not special: decoding keeps them, as Qwen3's do
    tok.chat_template = QWEN3_STYLE
    return tok


def answers(tok, messages, **kwargs):
    """The decoded text of every run of loss-mask ones, and the decoded text of everything else."""
    ids, mask, _ = ChatEncoder(tok, 4096, template_kwargs=kwargs).encode(messages)
    runs, current = [], []
    for t, m in zip([*ids, None], [*mask, 0], strict=True):
        if m:
            current.append(t)
        elif current:
            runs.append(tok.decode(current))
            current = []
    rest = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False, **kwargs)  # nothing lost
    return runs, rest


def test_thinking_on_the_reasoning_block_is_part_of_the_answer(tok):
    runs, rest = answers(tok, [U1, A1])
    assert runs == ["<think>\nTwo and two make four.\n</think>\n\nFour.<|im_end|>"]
    assert rest == "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n\n"


def test_thinking_off_the_prefilled_empty_block_gets_no_loss(tok):
    runs, rest = answers(tok, [U1, {"role": "assistant", "content": "Four."}], enable_thinking=False)
    assert runs == ["Four.<|im_end|>"]
    assert rest == (
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n\n"
    )
    # the same record with thinking on: the target emits the (empty) block itself
    runs, _ = answers(tok, [U1, {"role": "assistant", "content": "Four."}])
    assert runs == ["<think>\n\n</think>\n\nFour.<|im_end|>"]


def test_inline_think_content_masks_like_reasoning_content(tok):
    """Local regeneration writes the reasoning inline; a server's reasoning parser splits it off."""
    inline = {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\nFour."}
    assert answers(tok, [U1, inline]) == answers(tok, [U1, A1])


def test_history_turns_are_stripped_and_masked_as_rendered(tok):
    runs, rest = answers(tok, [U1, A1, U2, A2])
    assert runs == ["Four.<|im_end|>", "<think>\nThree and three make six.\n</think>\n\nSix.<|im_end|>"]
    assert "Two and two make four." not in rest  # the template dropped the history turn's reasoning
    # thinking off: records regenerated in that mode have no reasoning to keep
    a1, a2 = ({"role": "assistant", "content": a["content"]} for a in (A1, A2))
    runs, rest = answers(tok, [U1, a1, U2, a2], enable_thinking=False)
    assert runs == ["Four.<|im_end|>", "Six.<|im_end|>"]
    assert rest.count("<think>\n\n</think>\n\n") == 1  # pre-filled in the last turn only


def test_answer_tokens_follow_the_generation_prompt(tok):
    """The last answer's tokens are exactly what the target generates after the rendered prompt."""
    for kwargs in ({}, {"enable_thinking": False}):
        a2 = A2 if not kwargs else {"role": "assistant", "content": "Six."}
        ids, mask, _ = ChatEncoder(tok, 4096, template_kwargs=kwargs).encode([U1, A1, U2, a2])
        prompt = tok.apply_chat_template([U1, A1, U2], tokenize=False, add_generation_prompt=True, **kwargs)
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        assert ids[: len(prompt_ids)] == prompt_ids
        assert not mask[len(prompt_ids) - 1] and mask[len(prompt_ids)]


def test_job_chat_template_kwargs_reach_the_producer(tok, tmp_path):
    model_dir = build_tiny_target(tmp_path / "model", tok, num_layers=2, hidden_size=32, intermediate_size=64)
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": [U1, {"role": "assistant", "content": "Four."}]}])
    for kwargs, expected in (
        ({}, "<think>\n\n</think>\n\nFour.<|im_end|>"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "Four.<|im_end|>"),
    ):
        job_file = write_job(
            tmp_path / "job.toml",
            {
                "target": {"path": str(model_dir)},
                "data": {"path": str(data), "max_length": 64, "tokens_per_batch": 64, **kwargs},
                "drafters": [{"name": "d"}],
            },
        )
        dataset, _ = build_dataset(load_job(job_file), 0, 1)
        ids, mask = dataset.reader().read(0)
        assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == expected
    assert json.loads(json.dumps(load_job(job_file).data.chat_template_kwargs)) == {"enable_thinking": False}
