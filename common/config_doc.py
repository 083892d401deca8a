"""The job-file reference in Markdown, generated from the config models (docs/training.md embeds it).

python -m common.config_doc      # prints the reference; tests/e2e/test_readme.py checks docs/training.md has it
"""

from __future__ import annotations

import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from common.config import (
    DataConfig,
    DrafterConfig,
    JobSection,
    TargetConfig,
    TelemetryConfig,
    TransportConfig,
)

SECTIONS: list[tuple[str, type[BaseModel], str]] = [
    ("[job]", JobSection, "the job's name, run directory and seed"),
    ("[target]", TargetConfig, "the frozen target model"),
    ("[data]", DataConfig, "the dataset and the batch plan"),
    ("[transport]", TransportConfig, "the slot ring and the control channel"),
    ("[[drafters]]", DrafterConfig, "one table per drafter; every drafter trains on every batch"),
    ("[telemetry]", TelemetryConfig, "stats, W&B and the stats CLI"),
]


def _type_name(ann: object) -> str:
    if typing.get_origin(ann) is typing.Literal:
        return " or ".join(f'"{v}"' for v in typing.get_args(ann))
    text = ann.__name__ if isinstance(ann, type) else str(ann).replace("typing.", "")
    return f"`{text}`".replace("|", "\\|")  # a pipe would split the Markdown cell


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    return f"`{value!r}`".replace("'", '"')


def reference() -> str:
    lines = ["| key | type | default |", "|---|---|---|"]
    for title, model, what in SECTIONS:
        lines.append(f"| **{title}** | {what} | |")
        hints = typing.get_type_hints(model, include_extras=False)
        for name, field in model.model_fields.items():
            lines.append(f"| `{name}` | {_type_name(hints[name])} | {_default(field)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference())
