"""Chat tokenization, assistant-only loss masks across templates, dataset indexing and skipped records."""

import json
import logging

import pytest

from demo.tiny import corpus_texts, synthetic_chats, train_tokenizer, write_jsonl
from producer.data import ChatDataset, ChatEncoder, DataError, iter_messages
from producer.plan import BatchPlan
from producer.prefetch import Prefetcher

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Why is the river blue?"},
    {"role": "assistant", "content": "Because the sky is blue. Simple."},
    {"role": "user", "content": "And the garden?"},
    {"role": "assistant", "content": "Green, because of the queue."},
]
EOT = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def tok(request, tmp_path_factory):
    texts = list(corpus_texts(synthetic_chats(80, seed=5))) + [m["content"] for m in CHAT]
    tok = train_tokenizer(texts, 800, tmp_path_factory.mktemp(request.param), template=request.param)
    tok.template_name = request.param
    return tok


def runs_of_ones(mask):
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_loss_mask_is_one_exactly_on_assistant_answers(tok):
    ids, mask, full_length = ChatEncoder(tok, max_length=4096).encode(CHAT)
    assert len(ids) == len(mask) == full_length
    # lossless: the pieces tokenize back to the template's rendering
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, tokenize=False)
    answers = [m["content"] for m in CHAT if m["role"] == "assistant"]
    runs = runs_of_ones(mask)
    assert len(runs) == len(answers)
    for (start, end), answer in zip(runs, answers, strict=True):
        assert tok.decode(ids[start:end]) == answer + EOT[tok.template_name]
        assert ids[end - 1] == tok.convert_tokens_to_ids(EOT[tok.template_name])
    # every masked-out token is prompt or template scaffolding
    zero_text = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert all(a not in zero_text for a in answers)
    assert zero_text.count(EOT[tok.template_name]) == len(CHAT) - len(answers)


def test_answer_tokens_equal_generation_after_the_prompt(tok):
    """The answer is tokenized as the model would emit it after the generation prompt."""
    enc = ChatEncoder(tok, max_length=4096)
    ids, mask, _ = enc.encode(CHAT[:3])
    prompt = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids and not any(mask[: len(prompt_ids)])
    answer_end = len(prompt_ids) + sum(mask)
    assert all(mask[len(prompt_ids) : answer_end])
    assert tok.decode(ids[len(prompt_ids) : answer_end]) == CHAT[2]["content"] + EOT[tok.template_name]
    assert tok.decode(ids[answer_end:]).strip() == ""  # only the template's trailing whitespace is left


def test_truncation_cuts_ids_and_mask_together(tok):
    ids, mask, full_length = ChatEncoder(tok, max_length=10).encode(CHAT)
    assert len(ids) == len(mask) == 10 and full_length > 10


def test_tokenizer_without_chat_template_is_an_error(tok):
    bare = tok.__class__(tokenizer_object=tok.backend_tokenizer)
    with pytest.raises(DataError, match="no chat template"):
        ChatEncoder(bare, max_length=64, name="/models/x")


def test_bad_records_are_skipped_with_file_and_line(tok, tmp_path, caplog):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"messages": CHAT})
    lines = [
        good,
        '{"messages": [ broken',
        json.dumps({"messages": [{"role": "user", "content": "no answer here"}]}),
        "",
        json.dumps({"messages": []}),
        json.dumps({"messages": [{"role": "user"}]}),
        json.dumps([1, 2]),
        good,
    ]
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="producer.data"):
        ds = ChatDataset(path, "chat", ChatEncoder(tok, max_length=4096))
    assert len(ds) == 2
    assert ds.stats.records == 8
    assert ds.stats.skipped == {"malformed": 3, "no_assistant": 1, "empty": 2}
    text = caplog.text
    assert f"{path}:2: skipped record (malformed)" in text
    assert f"{path}:3: skipped record (no_assistant)" in text
    assert f"{path}:6: skipped record (malformed): messages[0]" in text
    reader = ds.reader()
    assert reader.read(1) == reader.read(0)
    reader.close()


def test_prompt_response_format_and_truncation_count(tok, tmp_path):
    path = write_jsonl(
        tmp_path / "pr.jsonl",
        [{"prompt": "Why?", "response": "Because."}, {"prompt": "x " * 200, "response": "long one"}],
    )
    ds = ChatDataset(path, "prompt_response", ChatEncoder(tok, max_length=32))
    assert len(ds) == 2 and ds.stats.truncated == 1
    assert ds.lengths[1] == 32
    plan = BatchPlan(ds.lengths, seed=0, epochs=1, tokens_per_batch=32, length_group_window=1)
    assert sorted(i for b in plan.batches_from(0) for i in b.sample_ids) == [0, 1]  # truncated, not dropped
    ids, mask = ds.reader().read(0)
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "Because." + EOT[tok.template_name]


def test_missing_and_empty_files_are_errors(tok, tmp_path):
    enc = ChatEncoder(tok, max_length=64)
    with pytest.raises(DataError, match="does not exist"):
        ChatDataset(tmp_path / "nope.jsonl", "chat", enc)
    (tmp_path / "bad.jsonl").write_text("nonsense\n")
    with pytest.raises(DataError, match="no usable record"):
        ChatDataset(tmp_path / "bad.jsonl", "chat", enc)


def test_iter_messages_for_prompts_keeps_records_without_answers(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    assert [n for n, _ in iter_messages(path, require_assistant=False)] == [1]
    assert list(iter_messages(path)) == []


def test_prefetcher_delivers_the_plan_in_order(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", synthetic_chats(30, seed=2))
    ds = ChatDataset(path, "chat", ChatEncoder(tok, max_length=64))
    plan = BatchPlan(ds.lengths, seed=1, epochs=2, tokens_per_batch=256, length_group_window=2)
    reader = ds.reader()
    seen = []
    with Prefetcher(ds, plan.batches_from(3), depth=2) as pf:
        while (batch := pf.get(timeout=10)) is not None:
            seen.append(batch.seq)
            assert batch.cu_seqlens[-1] == batch.num_tokens <= 256
            assert batch.input_ids.shape == batch.loss_mask.shape
            first = batch.sample_ids[0]
            ids, mask = reader.read(first)
            assert batch.input_ids[: len(ids)].tolist() == ids
            assert batch.loss_mask[: len(mask)].tolist() == mask
        assert pf.get(timeout=1) is None
    assert seen == list(range(3, len(plan)))


def test_prefetcher_reraises_worker_errors_and_times_out(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", synthetic_chats(4, seed=2))
    ds = ChatDataset(path, "chat", ChatEncoder(tok, max_length=64))

    def broken():
        raise OSError("disk gone")
        yield

    with Prefetcher(ds, broken(), depth=1) as pf, pytest.raises(RuntimeError, match="disk gone"):
        pf.get(timeout=10)

    def never():
        import time

        time.sleep(1.0)
        yield from ()

    with Prefetcher(ds, never(), depth=1) as pf, pytest.raises(TimeoutError):
        pf.get(timeout=0.05)
