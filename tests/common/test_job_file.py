"""common/job_file.py: job files written from the config's values; tomllib reads back exactly what was written."""

import math
import tomllib

import pytest

from common.config import ConfigError, parse_job
from common.job_file import dumps, job_doc, job_text, write_job_file

DOC = {
    "job": {"name": "jf", "run_dir": "/tmp/jf-run", "seed": 3},
    "target": {"path": "/models/t", "dtype": "float32", "layer_ids": [1, 3], "replicas": 1},
    "data": {
        "path": "/data/c.jsonl",
        "max_length": 64,
        "tokens_per_batch": 128,
        "shard_by_node": False,
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "telemetry": {"interval_s": 0.5},
    "drafters": [{"name": "d0", "lr": 0.0003}, {"name": "d1", "block_size": 4, "replicas": 2}],
}


def test_every_value_type_reads_back_equal():
    doc = {
        "s": 'quote " backslash \\ newline \n tab \t é ✓',
        "i": -7,
        "f": 2.5e-05,
        "big": 10**15,
        "t": True,
        "f0": False,
        "l": [1, 2, 3],
        "ls": ["a", "b"],
        "empty": [],
        "nested": [[1, 2], [3]],
        "inline": [{"a": 1}, 2],
        "key with space": 1,
        "table": {"x": 1, "sub": {"y": "z"}},
        "tables": [{"n": 1, "inner": {"k": 2}}, {"n": 2}],
    }
    text = dumps(doc)
    assert tomllib.loads(text) == doc
    assert "\n[table.sub]\n" in text and text.count("[[tables]]") == 2 and '"key with space" = 1' in text


def test_none_is_left_out_and_bool_is_not_an_int_and_special_floats_survive():
    back = tomllib.loads(
        dumps({"a": None, "b": True, "c": 1, "d": {"e": None, "f": 0}, "g": math.inf, "h": -math.inf, "n": math.nan})
    )
    assert back["b"] is True and back["c"] == 1 and type(back["c"]) is int
    assert "a" not in back and back["d"] == {"f": 0}
    assert back["g"] == math.inf and back["h"] == -math.inf and math.isnan(back["n"])


def test_a_value_toml_cannot_hold_names_where_it_is():
    with pytest.raises(TypeError, match=r"^t\.when: TOML has no value for object"):
        dumps({"t": {"when": object()}})


def test_a_dict_is_validated_before_it_is_written(tmp_path):
    path = tmp_path / "job.toml"
    write_job_file(path, DOC)
    assert tomllib.loads(path.read_text()) == DOC
    with pytest.raises(ConfigError, match=r"(?s)bad\.toml: invalid job file.*drafters\.0\.blok_size: unknown key"):
        write_job_file(tmp_path / "bad.toml", {**DOC, "drafters": [{"name": "d0", "blok_size": 4}]})
    assert not (tmp_path / "bad.toml").exists()


def test_a_validated_job_round_trips_and_the_header_is_a_comment():
    job = parse_job(DOC)
    text = job_text(job, header="first line\n\nthird")
    assert text.startswith("# first line\n#\n# third\n[job]\n")
    assert parse_job(tomllib.loads(text)) == job
    assert job_doc(job)["drafters"][1]["replicas"] == 2
