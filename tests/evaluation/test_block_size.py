"""dflash-eval refuses a block size other than the trained one (issue 30 §2): one line, exit 2, before any model
loads; the trained block is read where the export records it (dflash_config.block_size, then block_size)."""

from __future__ import annotations

import json

import pytest

from evaluation.block_size import check_block_size, trained_block_size


def test_the_trained_block_is_read_where_the_engines_read_it():
    assert trained_block_size({"block_size": 8, "dflash_config": {"block_size": 4}}) == 4  # z-lab reads it first
    assert trained_block_size({"block_size": 7, "dflash_config": {}}) == 7  # DSpark's top-level key
    assert trained_block_size({"dflash_config": {"target_layer_ids": [1]}}) == 16  # z-lab's and SGLang's default


def _export(tmp_path, config: dict):
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes(b"")  # never read: the check comes first
    return d


def test_a_mismatch_is_one_line_naming_the_file_and_both_sizes(tmp_path):
    d = _export(tmp_path, {"block_size": 8, "dflash_config": {"block_size": 8}})
    assert check_block_size(d, None) == 8 and check_block_size(d, 8) == 8
    with pytest.raises(ValueError, match=r"--block-size 16: .*config.json was trained at block size 8"):
        check_block_size(d, 16)


def test_dflash_eval_exits_2_on_another_block_size(tmp_path, capsys):
    from evaluation.cli import main

    d = _export(tmp_path, {"architectures": ["Qwen3DSparkModel"], "block_size": 7})
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    args = ["--target", str(tmp_path / "no-target"), "--drafter", str(d), "--prompts", str(tmp_path / "p.jsonl")]
    assert main([*args, "--block-size", "8"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash-eval: --block-size 8: ") and "block size 7" in lines[0]
    # the trained size passes the check (and fails later, on the missing target: another line)
    assert main([*args, "--block-size", "7"]) == 2
    assert "block size" not in capsys.readouterr().err
