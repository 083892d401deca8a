"""The run folder's layout: where a job keeps its sockets, logs, telemetry, W&B files and checkpoints.

`JobConfig.run_paths` gives a job's; a tool that has only a run folder (the stats CLI, bench) builds one from it.
"""

from __future__ import annotations

from pathlib import Path


class RunPaths:
    """Where a job keeps its files: one place that knows the run directory's layout."""

    def __init__(self, root: Path):
        self.root = Path(root)

    @property
    def sockets(self) -> Path:
        return self.root / "sockets"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def telemetry(self) -> Path:
        return self.root / "telemetry"

    @property
    def metrics_jsonl(self) -> Path:
        return self.telemetry / "metrics.jsonl"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def job_copy(self) -> Path:
        return self.root / "job.toml"

    def checkpoints(self, drafter: str) -> Path:
        return self.root / "checkpoints" / drafter

    @staticmethod
    def control_socket(producer: int = 0) -> str:
        """The control socket's file name in sockets/ of target replica `producer` (its producer)."""
        return "control.sock" if producer == 0 else f"control-p{producer}.sock"

    def control_endpoint(self, producer: int = 0) -> Path:
        """Where target replica `producer`'s producer writes the endpoint it listens on."""
        return self.sockets / ("control.endpoint" if producer == 0 else f"control-p{producer}.endpoint")

    def ipc(self, name: str) -> str:
        return f"ipc://{(self.sockets / name).resolve()}"

    def make(self) -> None:
        """Create the layout; sockets/ is private to the job's user (0700)."""
        for d in (self.root, self.logs, self.telemetry, self.wandb):
            d.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(parents=True, exist_ok=True)
        self.sockets.chmod(0o700)
