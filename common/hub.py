"""Targets, tokenizers and datasets named as the ecosystem names them: Hugging Face hub ids.

`target.path = "Qwen/Qwen3-8B"` (or `data.tokenizer`, or `data.path = "HuggingFaceH4/ultrachat_200k"`) is a
hub id when it is `owner/name` and no such local path exists. It resolves through `huggingface_hub`'s own
cache (`HF_HOME` / `HF_HUB_CACHE`, revision pinning with `target.revision` / `data.revision`, `HF_HUB_OFFLINE`
honoured, its progress bars on a download) to the snapshot folder, and from then on is a local path like any
other. A dataset resolves to its data files for `data.split` (and `data.subset`) by the rules the `datasets`
library uses for a hub repository (the dataset card's `configs`, else its file-name patterns); the files are
Parquet or JSON lines and are streamed by producer/records.py, never loaded whole.

Resolution happens once per process in `load_job` (common/config.py); launch.sh's plan step loads the job
before any process starts, so a download happens there, in the foreground, and the processes find the cache.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


class HubError(ValueError):
    """A hub id that cannot be resolved; the message names the key, the id and how to go on."""


def is_hub_id(spec: str) -> bool:
    return bool(HUB_ID.match(spec)) and not Path(spec).exists()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def snapshot(
    repo_id: str, revision: str | None, *, key: str, repo_type: str = "model", allow_patterns: list[str] | None = None
) -> Path:
    """The local snapshot folder of a hub repository: from the cache, downloaded first when online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{key} = {repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    try:
        return Path(
            snapshot_download(
                repo_id,
                repo_type=repo_type,
                revision=revision,
                allow_patterns=allow_patterns,
                local_files_only=_offline(),
            )
        )
    except LocalEntryNotFoundError:
        from huggingface_hub.constants import HF_HUB_CACHE

        how = (
            (
                "HF_HUB_OFFLINE is set: unset it to download, or fetch it first with `hf download"
                f" {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}`"
            )
            if _offline()
            else ("the hub could not be reached: check the network, or download it where it can be reached")
        )
        raise HubError(f"{where}: not in the Hugging Face cache ({HF_HUB_CACHE}); {how}") from None
    except GatedRepoError:
        raise HubError(
            f"{where}: a gated repository: accept its terms on the hub and log in (`hf auth login`) or set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise HubError(f"{where}: the repository has no such revision") from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{where}: no such {repo_type} repository on the hub (or it is private: set HF_TOKEN);"
            " a local path must exist"
        ) from None
    except HfHubHTTPError as err:
        raise HubError(f"{where}: the hub answered {err}") from None


def model_dir(spec: str, revision: str | None, key: str) -> str:
    """`spec` itself when it is a local path, else the snapshot folder of the hub model it names."""
    if not is_hub_id(spec):
        return spec
    return str(snapshot(spec, revision, key=key, allow_patterns=MODEL_FILES))


def dataset_files(spec: str, split: str, subset: str | None, revision: str | None) -> list[Path]:
    """The data files of one split of a hub dataset, in the order `datasets` would read them."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    root = snapshot(spec, revision, key="data.path", repo_type="dataset")
    patterns = _card_patterns(root, subset, spec)
    if patterns is None and subset is not None:
        raise HubError(f"data.subset = {subset!r}: the dataset card of {spec!r} declares no configs")
    patterns = patterns or get_data_patterns(str(root))
    files = DataFilesDict.from_patterns(patterns, str(root))
    if split not in files:
        raise HubError(f"data.split = {split!r}: {spec!r} has the splits {sorted(files)}")
    chosen = [Path(f) for f in files[split]]
    unreadable = [f.name for f in chosen if f.suffix.lower() not in DATA_SUFFIXES]
    if unreadable:
        raise HubError(
            f"data.path = {spec!r}: split {split!r} is stored as {unreadable[:3]}; the producer reads"
            " Parquet and JSON lines (the hub's `refs/convert/parquet` revision has Parquet for most"
            ' datasets: set data.revision = "refs/convert/parquet")'
        )
    return chosen


def _card_patterns(root: Path, subset: str | None, spec: str) -> dict[str, list[str]] | None:
    """The split → file patterns a dataset card's `configs` declares for `subset` (or its default)."""
    card = root / "README.md"
    if not card.is_file():
        return None
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(card).data)
    if not configs:
        return None
    name = subset or next((n for n, c in configs.items() if c.get("default")), None) or next(iter(configs))
    if name not in configs:
        raise HubError(f"data.subset = {name!r}: {spec!r} has the subsets {sorted(configs)}")
    data_files = configs[name].get("data_files")
    if isinstance(data_files, str):
        return {"train": [data_files]}
    if isinstance(data_files, list) and data_files and isinstance(data_files[0], dict):
        return {d["split"]: [d["path"]] if isinstance(d["path"], str) else list(d["path"]) for d in data_files}
    return None
