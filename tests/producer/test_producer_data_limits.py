"""Indexing is linear in a record and bounded per record (issue 24 item 6), and its tokens are exactly those of
tokenizing every rendered piece whole and cutting at max_length; plus the size messages that name their key."""

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.ring import RingError, SlotRing
from consumer.target_parts import TargetPartsError, load_target_parts
from demo.tiny import corpus_texts, synthetic_chats, train_tokenizer
from producer.data import ChatDataset, ChatEncoder, DataError, RecordLimits
from producer.target import TargetLoadError, load_target


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def tok(request, tmp_path_factory):
    texts = list(corpus_texts(synthetic_chats(80, seed=5)))
    return train_tokenizer(texts, 800, tmp_path_factory.mktemp(request.param), template=request.param)


def reference_encode(enc: ChatEncoder, messages):
    """Today's contract computed the direct way: every piece tokenized whole, then cut at max_length."""
    ids, mask = [], []
    for text, answer in list(enc.pieces(messages)):
        piece = enc.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(answer)] * len(piece)
    return ids[: enc.max_length], mask[: enc.max_length], len(ids)


class Counting:
    """Wraps a tokenizer to count the characters it tokenizes and the messages its template renders."""

    def __init__(self, tok):
        self.tok, self.chars, self.rendered = tok, 0, 0

    def __call__(self, texts, **kw):
        self.chars += sum(map(len, [texts] if isinstance(texts, str) else texts))
        return self.tok(texts, **kw)

    def apply_chat_template(self, messages, **kw):
        self.rendered += len(messages)
        return self.tok.apply_chat_template(messages, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_tokens_equal_whole_piece_tokenization_on_varied_records(tok):
    rng = random.Random(3)
    chats = [c["messages"] for c in synthetic_chats(16, seed=11, max_turns=6)]
    long_answer = " ".join(rng.choice(["alpha", "beta", "gamma", "12345", "\n", "x"]) for _ in range(6000))
    chats.append([{"role": "user", "content": "tell me"}, {"role": "assistant", "content": long_answer}])
    chats.append([{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(120)])
    checked = truncated = 0
    for max_length in (8, 200, 4096):
        enc = ChatEncoder(tok, max_length)
        for messages in chats:
            ids, mask, full = enc.encode(messages)
            ref_ids, ref_mask, ref_full = reference_encode(enc, messages)
            assert (ids, mask) == (ref_ids, ref_mask)
            if ref_full > max_length:
                assert max_length < full <= ref_full  # a lower bound once the rest is never tokenized
                truncated += 1
            else:
                assert full == ref_full
            checked += 1
    assert checked == 3 * len(chats) and truncated > len(chats)


def test_a_long_conversation_is_rendered_and_tokenized_linearly(tok):
    """100k messages: the old encoder rendered a prefix per assistant turn (~10^10 messages rendered)."""
    max_length = 256
    for n in (2_000, 100_000):  # 2k: the old encoder's ~3M rendered messages fail fast; 100k: the real case
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"word {i}"} for i in range(n)]
        counting = Counting(tok)
        ids, mask, full = ChatEncoder(counting, max_length).encode(messages)
        assert len(ids) == max_length and full > max_length and sum(mask) > 0
        assert counting.rendered < n + 20_000  # the conversation once, plus the prefixes of the first turns
        assert counting.chars < 20 * max_length * 8
    assert (ids, mask) == reference_encode(ChatEncoder(tok, max_length), messages[:400])[:2]


def test_a_huge_answer_is_tokenized_by_prefixes_not_whole(tok):
    answer = "abc def ghi " * 400_000  # 4.8 MB in one piece
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
    counting = Counting(tok)
    ids, mask, full = ChatEncoder(counting, 512).encode(messages)
    assert len(ids) == 512 and full > 512
    assert counting.chars < 50_000  # of 4.8 MB
    short = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer[:20_000]}]
    assert (ids, mask) == reference_encode(ChatEncoder(tok, 512), short)[:2]


def test_records_over_the_size_or_time_bound_are_skipped_with_file_and_line(tok, tmp_path, caplog):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    big = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "y" * 300_000}]}
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, big, good)) + "\n")
    enc = ChatEncoder(tok, 64)
    with caplog.at_level("WARNING"):
        ds = ChatDataset(path, "chat", enc, RecordLimits(max_bytes=100_000))
    assert len(ds) == 2 and dict(ds.stats.skipped) == {"too_large": 1}
    assert f"{path}:2: skipped record (too_large): the line has" in caplog.text
    assert "over data.max_record_bytes = 100000" in caplog.text
    reader = ds.reader()  # positions after the skipped line still point at their records
    assert [reader.read(i) for i in range(2)] == [enc.encode(good["messages"])[:2]] * 2
    reader.close()

    table = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([good, big]), table)
    ds = ChatDataset(table, "chat", enc, RecordLimits(max_bytes=100_000))
    assert len(ds) == 1 and dict(ds.stats.skipped) == {"too_large": 1}

    with caplog.at_level("WARNING"), pytest.raises(DataError, match=r"no usable record \({'too_slow': 3} skipped"):
        ChatDataset(path, "chat", enc, RecordLimits(max_seconds=1e-9))
    assert f"{path}:1: skipped record (too_slow)" in caplog.text and "data.record_time_limit_s" in caplog.text


def test_size_messages_name_their_key(tmp_path):
    with pytest.raises(RingError, match=r"ring needs [0-9.]+ TiB .*data\.tokens_per_batch"):
        SlotRing.create("cpu", 4, 1 << 42, name=f"limits-{tmp_path.name}")
    model_file = tmp_path / "model.safetensors"
    model_file.write_bytes(b"x")
    with pytest.raises(TargetLoadError, match=r"model\.safetensors: is a file, not a model directory"):
        load_target(model_file, dtype="float32")
    with pytest.raises(TargetPartsError, match=r"model\.safetensors: is a file, not a model directory"):
        load_target_parts(model_file)
