"""The batch plan's fingerprint and the start check (producer/fingerprint.py): what changes it, what does not,
and what a rerun is told."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from producer.fingerprint import PlanChanged, check_plan, plan_fingerprint

LINES = [
    json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * i}]})
    for i in range(40)
]


@pytest.fixture
def setup(tmp_path):
    data, tok = tmp_path / "data.jsonl", tmp_path / "tok"
    data.write_text("\n".join(LINES) + "\n")
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (tok / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    return data, tok


def fingerprint(data: Path, tok: Path, **kw) -> dict:
    args = dict(
        data_path=data,
        data_format="chat",
        tokenizer_dir=tok,
        chat_template_kwargs={},
        max_length=256,
        tokens_per_batch=512,
        length_group_window=64,
        seed=7,
        shard=(0, 1),
        lengths=list(range(1, 41)),
    )
    return plan_fingerprint(**{**args, **kw})


def plan_record(fp: dict, epochs: int = 3, lineage: str = "main") -> dict:
    return {"kind": "plan", "node": 0, "lineage": lineage, "fingerprint": fp, "epochs": [{}] * epochs}


def refusal(previous: list[dict], fp: dict, lineage: str = "main", epochs: int = 3) -> str:
    with pytest.raises(PlanChanged) as err:
        check_plan(previous, lineage, fp, epochs, "/runs/r")
    return str(err.value)


def test_appended_or_shuffled_data_is_refused_naming_the_data_and_the_ways_on(setup):
    data, tok = setup
    before = [plan_record(fingerprint(data, tok))]
    data.write_text("\n".join([*LINES, LINES[0]]) + "\n")
    msg = refusal(before, fingerprint(data, tok))
    assert msg.startswith("the batch plan of /runs/r changed since its last start (the data file's size (data.path):")
    assert "the data file's content (data.path)" in msg and f"data file {data.resolve()}" in msg
    assert "start a new run folder (job.run_dir)" in msg and 'data.lineage = "2"' in msg and "\n" not in msg
    shuffled = LINES[:]
    random.Random(0).shuffle(shuffled)
    data.write_text("\n".join(shuffled) + "\n")  # the same bytes in another order: the same size
    msg = refusal(before, fingerprint(data, tok))
    assert "the data file's content (data.path)" in msg and "size" not in msg.split("(data.path)")[0]


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("max_length", 128, "data.max_length: 256 → 128"),
        ("tokens_per_batch", 1024, "data.tokens_per_batch: 512 → 1024"),
        ("length_group_window", 8, "data.length_group_window: 64 → 8"),
        ("seed", 8, "job.seed: 7 → 8"),
        ("shard", (1, 2), "the node's data shard [index, count]"),
        (
            "chat_template_kwargs",
            {"enable_thinking": False},
            "data.chat_template_kwargs: {} → {'enable_thinking': False}",
        ),
        ("data_format", "prompt_response", "data.format: chat → prompt_response"),
        ("lengths", [2] * 40, "the samples' token lengths"),
    ],
)
def test_every_plan_input_but_epochs_is_compared(setup, key, value, named):
    data, tok = setup
    msg = refusal([plan_record(fingerprint(data, tok))], fingerprint(data, tok, **{key: value}))
    assert named in msg


def test_a_changed_chat_template_is_refused(setup):
    data, tok = setup
    before = [plan_record(fingerprint(data, tok))]
    (tok / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}!"}')
    assert "the tokenizer or its chat template" in refusal(before, fingerprint(data, tok))


def test_a_copied_or_touched_data_file_and_raised_or_lowered_epochs_are_the_same_plan(setup, tmp_path):
    data, tok = setup
    before = [plan_record(fingerprint(data, tok))]
    copy = tmp_path / "elsewhere.jsonl"
    shutil.copyfile(data, copy)
    os.utime(copy, (1, 1))
    assert (
        check_plan(before, "main", fingerprint(copy, tok), 3, "/r")
        == "data lineage 'main': the plan matches the run's (3 epoch(s))"
    )
    assert (
        check_plan(before, "main", fingerprint(data, tok), 5, "/r")
        == "data lineage 'main': epochs raised 3 → 5; the trained epochs stay, 2 appended"
    )
    assert check_plan(before, "main", fingerprint(data, tok), 2, "/r").startswith(
        "data lineage 'main': epochs lowered 3 → 2; the plan now ends after epoch 1"
    )


def test_lineages_a_new_name_starts_a_plan_an_earlier_one_is_refused(setup):
    data, tok = setup
    old, new = fingerprint(data, tok), fingerprint(data, tok, seed=9)
    assert check_plan([], "main", old, 3, "/r") == "data lineage 'main': a new plan of 3 epoch(s)"
    history = [plan_record(old), plan_record(old)]
    assert check_plan(history, "2", new, 1, "/r") == (
        "data lineage '2' starts a new plan of 1 epoch(s) from the drafters' current weights (after 'main')"
    )
    history.append(plan_record(new, 1, "2"))
    assert "the plan matches" in check_plan(history, "2", new, 1, "/r")
    assert 'data.lineage = "3"' in refusal(history, old, "2")  # lineage 2 changed again: name a third
    msg = refusal(history, old, "main")
    assert msg.startswith('data.lineage = "main" was followed by "2" in /runs/r') and 'data.lineage = "2"' in msg


def test_a_run_whose_plan_records_carry_no_fingerprint_records_one(setup):
    data, tok = setup
    note = check_plan([{"kind": "plan", "node": 0, "epochs": [{}]}], "main", fingerprint(data, tok), 1, "/r")
    assert note == "data lineage 'main': the run's earlier plan records carry no fingerprint; recording one now"
