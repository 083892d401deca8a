"""Targets, tokenizers and datasets named by hub id resolve from a Hugging Face cache, offline (issue 22 item 4).

The cache is built here in huggingface_hub's own layout (`models--owner--name/snapshots/<commit>`,
`refs/main`); HF_HUB_OFFLINE=1 is set for every test (tests/conftest.py), so nothing is ever fetched.
"""

import shutil

import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.config import ConfigError, load_job
from consumer.target_parts import load_target_parts
from producer.build import build_dataset, checked_fingerprint
from tests.jobs import tiny_assets, write_job

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CARD = """---
configs:
- config_name: short
  data_files:
  - split: train
    path: short/train-*.parquet
- config_name: default
  default: true
  data_files:
  - split: train
    path: data/train-*.parquet
  - split: test
    path: data/test-*.parquet
---
# chats
"""


def _repo(cache, kind: str, repo_id: str):
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return repo / "snapshots" / COMMIT


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """org/tiny (the tiny target + tokenizer) and org/chats (two train shards, a test split, a subset)."""
    assets = tiny_assets(tmp_path_factory.getbasetemp() / "tiny-assets")
    cache = tmp_path_factory.mktemp("hf-hub")
    shutil.copytree(assets / "target", _repo(cache, "model", "org/tiny"))
    data = _repo(cache, "dataset", "org/chats")
    for sub in ("data", "short"):
        (data / sub).mkdir(parents=True)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"what is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
            ]
        }
        for i in range(30)
    ]
    pq.write_table(pa.Table.from_pylist(rows[:12]), data / "data" / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[12:20]), data / "data" / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[20:]), data / "data" / "test-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:5]), data / "short" / "train-00000-of-00001.parquet")
    (data / "README.md").write_text(CARD)
    return cache, assets, rows


@pytest.fixture
def offline_cache(hub_cache, monkeypatch):
    cache, assets, rows = hub_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache, assets, rows


def _hub_job(assets, data_keys: str, target: str = "org/tiny"):
    job = write_job(assets)
    text = job.read_text().replace(f'path = "{assets / "target"}"', f'path = "{target}"')
    job.write_text(text.replace(f'path = "{assets / "train.jsonl"}"', f'path = "org/chats"\n{data_keys}'))
    return job


def test_target_and_dataset_resolve_from_the_cache_offline(offline_cache):
    cache, assets, rows = offline_cache
    job = load_job(_hub_job(assets, ""))
    snapshot = cache / "models--org--tiny" / "snapshots" / COMMIT
    assert job.target.path == str(snapshot) and job.data.path == "org/chats"
    parts = load_target_parts(job.target.path)  # the consumer's side reads the same snapshot
    assert parts.embed_tokens.shape[0] > 0
    dataset, plan = build_dataset(job, 0, 1)  # the producer's: both train shards, in order, streamed
    assert len(dataset) == 20 and len(plan) >= 1
    reader = dataset.reader()
    first, last = reader.read(0), reader.read(19)
    reader.close()
    expect = [dataset.encoder.encode(rows[i]["messages"])[:2] for i in (0, 19)]
    assert [first, last] == expect
    shards = sorted((cache / "datasets--org--chats" / "snapshots" / COMMIT / "data").glob("train-*"))
    fingerprint = checked_fingerprint(job, dataset, 0, 1)  # the plan identity covers both shards' bytes
    assert dataset.files == shards and fingerprint["data_bytes"] == sum(f.stat().st_size for f in shards)
    assert fingerprint["data_path"] == "org/chats"


def test_split_and_subset_select_the_files_the_card_declares(offline_cache):
    _, assets, _ = offline_cache
    assert len(build_dataset(load_job(_hub_job(assets, 'split = "test"')), 0, 1)[0]) == 10
    assert len(build_dataset(load_job(_hub_job(assets, 'subset = "short"')), 0, 1)[0]) == 5
    with pytest.raises(ConfigError, match=r"data\.split = 'dev': 'org/chats' has the splits \['test', 'train'\]"):
        load_job(_hub_job(assets, 'split = "dev"'))
    with pytest.raises(ConfigError, match=r"data\.subset = 'long': 'org/chats' has the subsets \['default', 'short'\]"):
        load_job(_hub_job(assets, 'subset = "long"'))


def test_an_uncached_hub_id_offline_is_one_clear_error(offline_cache):
    _, assets, _ = offline_cache
    with pytest.raises(ConfigError) as err:
        load_job(_hub_job(assets, "", target="org/absent"))
    message = str(err.value)
    assert "target.path = 'org/absent': not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE is set" in message and "hf download org/absent" in message
    with pytest.raises(ConfigError, match=r"revision 'v2'\): not in the Hugging Face cache"):
        load_job(_with_text(_hub_job(assets, ""), "[target]", '[target]\nrevision = "v2"'))


def _with_text(job, old, new):
    job.write_text(job.read_text().replace(old, new, 1))
    return job
