"""Inputs: ShareGPT conversations, Parquet and Arrow files give the token stream of the equivalent JSONL;
bad records are skipped with file:row; directories and empty files are clear errors; data-stats."""

import json
import logging
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.harness import write_job
from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl
from producer.data import ChatDataset, ChatEncoder, DataError, iter_messages
from producer.data_stats import planned_steps
from producer.plan import BatchPlan
from producer.prefetch import Prefetcher
from producer.regenerate import iter_prompts

SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(corpus_texts(synthetic_chats(80, seed=5)), 700, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def chats():
    return list(synthetic_chats(40, seed=9))


def sharegpt(rec):
    return {"conversations": [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in rec["messages"]]}


def write_parquet(path, records, row_group_size=7):
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def write_arrow_stream(path, records):
    """An Arrow IPC stream, the format of `datasets`' cache and save_to_disk shards."""
    table = pa.Table.from_pylist(records)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=5):
            writer.write_batch(batch)
    return path


def token_stream(path, tok, epochs=2):
    """Every packed batch of a two-epoch plan, as the producer's prefetch thread makes them."""
    ds = ChatDataset(path, "chat", ChatEncoder(tok, max_length=96))
    plan = BatchPlan(ds.lengths, seed=3, epochs=epochs, tokens_per_batch=256, length_group_window=2)
    out = []
    with Prefetcher(ds, plan.batches_from(0), depth=2) as pf:
        while (b := pf.get(timeout=30)) is not None:
            out.append((b.sample_ids, b.input_ids.tolist(), b.loss_mask.tolist(), b.cu_seqlens.tolist()))
    return ds, out


def test_sharegpt_parquet_and_arrow_give_the_jsonl_token_stream(tok, chats, tmp_path):
    jsonl = write_jsonl(tmp_path / "chats.jsonl", chats)
    _, expected = token_stream(jsonl, tok)
    assert len(expected) > 4
    inputs = {
        "sharegpt.jsonl": write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt(c) for c in chats]),
        "chats.parquet": write_parquet(tmp_path / "chats.parquet", chats),
        "sharegpt.parquet": write_parquet(tmp_path / "sharegpt.parquet", [sharegpt(c) for c in chats]),
        "chats.arrow": write_arrow_stream(tmp_path / "chats.arrow", chats),
    }
    for name, path in inputs.items():
        ds, stream = token_stream(path, tok)
        assert stream == expected, name
        assert ds.stats.records == len(chats) and not ds.stats.skipped


def test_table_columns_not_needed_are_not_read_and_none_fields_are_absent(tok, chats, tmp_path):
    # a reasoning_content struct field that most rows lack comes back as None: it must not break them
    rows = [
        {"messages": [dict(m, reasoning_content=None) for m in c["messages"]], "id": i, "source": "x"}
        for i, c in enumerate(chats)
    ]
    path = write_parquet(tmp_path / "extra.parquet", rows)
    ds = ChatDataset(path, "chat", ChatEncoder(tok, max_length=96))
    assert ds.records.columns == ["messages"]
    plain = ChatDataset(write_jsonl(tmp_path / "p.jsonl", chats), "chat", ChatEncoder(tok, max_length=96))
    assert ds.lengths == plain.lengths


def test_bad_table_rows_are_skipped_with_file_and_row(tok, chats, tmp_path, caplog):
    rows = [sharegpt(c) for c in chats[:4]]
    rows[1] = {"conversations": [{"from": "wizard", "value": "hi"}]}
    rows[2] = {"conversations": [{"from": "human", "value": "only a question"}]}
    path = write_parquet(tmp_path / "bad.parquet", rows, row_group_size=2)
    with caplog.at_level(logging.WARNING, logger="producer.data"):
        ds = ChatDataset(path, "chat", ChatEncoder(tok, max_length=96))
    assert len(ds) == 2 and ds.stats.skipped == {"malformed": 1, "no_assistant": 1}
    assert f"{path}:row 2: skipped record (malformed): conversations[0].from is 'wizard'" in caplog.text
    assert f"{path}:row 3: skipped record (no_assistant)" in caplog.text
    reader = ds.reader()
    assert reader.read(1) == ChatDataset(
        write_jsonl(tmp_path / "r.jsonl", [chats[3]]), "chat", ChatEncoder(tok, max_length=96)
    ).reader().read(0)


def test_directory_empty_and_unreadable_files_are_clear_errors(tok, tmp_path):
    enc = ChatEncoder(tok, max_length=64)
    with pytest.raises(DataError, match="is a directory, not a data file"):
        ChatDataset(tmp_path, "chat", enc)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.jsonl: data file is empty"):
        ChatDataset(tmp_path / "empty.jsonl", "chat", enc)
    (tmp_path / "fake.parquet").write_text("not parquet at all")
    with pytest.raises(DataError, match=r"fake\.parquet: not a readable Parquet file"):
        ChatDataset(tmp_path / "fake.parquet", "chat", enc)
    write_parquet(tmp_path / "cols.parquet", [{"text": "a"}])
    with pytest.raises(DataError, match=r"has none of the columns \['messages', 'conversations'\]"):
        ChatDataset(tmp_path / "cols.parquet", "chat", enc)
    with pytest.raises(DataError):
        iter_messages(tmp_path / "missing.parquet")


def test_planned_steps_count_rounds_and_accumulation():
    assert planned_steps([10, 10, 10, 10, 10], replicas=1, tokens_per_step=0) == (5, 0)
    assert planned_steps([10, 10, 10, 10, 10], replicas=2, tokens_per_step=0) == (3, 0)
    # the plan's end trains what is left as a partial last step (consumer/service.py): 30 + 20, 40 + 10 tokens
    assert planned_steps([10, 10, 10, 10, 10], replicas=1, tokens_per_step=25) == (2, 20)
    assert planned_steps([10, 10, 10, 10, 10], replicas=2, tokens_per_step=25) == (2, 10)
    assert planned_steps([10, 10, 10, 10], replicas=1, tokens_per_step=20) == (2, 0)


def test_data_stats_command(tok, chats, tmp_path):
    model_dir = build_tiny_target(tmp_path / "model", tok, num_layers=2, hidden_size=32, intermediate_size=64)
    data = write_jsonl(tmp_path / "d.jsonl", chats)
    with data.open("a") as f:
        f.write("{broken\n" + json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    job = tmp_path / "job.toml"
    write_job(
        job,
        {
            "job": {"run_dir": f"{tmp_path}/run", "seed": 3},
            "target": {"path": str(model_dir)},
            "data": {
                "path": str(data),
                "max_length": 96,
                "tokens_per_batch": 256,
                "epochs": 2,
                "length_group_window": 2,
            },
            "drafters": [{"name": "a", "total_steps": 10000}, {"name": "b", "tokens_per_step": 512, "total_steps": 5}],
        },
    )
    cmd = [sys.executable, "-m", "producer", "data-stats", str(job)]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr
    proc = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout)
    # the same numbers as the producer's own index and plan
    ds = ChatDataset(data, "chat", ChatEncoder(tok, max_length=96))
    plan = BatchPlan(ds.lengths, seed=3, epochs=2, tokens_per_batch=256, length_group_window=2)
    assert report["records"] == 42 and report["usable"] == 40
    assert report["skipped"] == {"malformed": 1, "no_assistant": 1}
    assert report["tokens"] == sum(ds.lengths) and report["loss_tokens"] == ds.stats.loss_tokens
    assert 0 < report["loss_fraction"] < 1
    assert report["batches_per_epoch"] == [plan.batches_per_epoch(0), plan.batches_per_epoch(1)]
    assert sum(c for _, _, c in report["length_histogram"]) == 40
    a, b = report["drafters"]
    assert a["planned_steps"] == len(plan)
    assert (
        b["planned_steps"]
        == planned_steps(
            [int(sum(ds.lengths[i] for i in ids)) for e in range(2) for ids in plan.epoch_batches(e)], 1, 512
        )[0]
    )
    assert f"drafter a: total_steps = 10000 but the plan makes {len(plan)} steps" in proc.stderr
    assert f"set total_steps = {b['planned_steps']}" in text.stdout
    assert f"batches per epoch {report['batches_per_epoch']}" in text.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "producer", "data-stats", str(tmp_path / "nope.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "cannot read job file" in bad.stderr and "Traceback" not in bad.stderr


def test_regenerate_reads_prompts_from_every_format(chats, tmp_path):
    expected = list(iter_prompts(write_jsonl(tmp_path / "p.jsonl", chats)))
    assert len(expected) == len(chats)
    assert list(iter_prompts(write_jsonl(tmp_path / "s.jsonl", [sharegpt(c) for c in chats]))) == expected
    assert list(iter_prompts(write_parquet(tmp_path / "p.parquet", chats))) == expected
    assert list(iter_prompts(write_arrow_stream(tmp_path / "p.arrow", [sharegpt(c) for c in chats]))) == expected
    with pytest.raises(DataError, match="is a directory"):
        iter_prompts(tmp_path)
