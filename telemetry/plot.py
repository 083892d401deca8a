"""`python -m telemetry.plot RUN_DIR` (or `dflash-stats RUN_DIR --plot`): pictures of a run, as PNG files.

    RUN_DIR/plots/training.png     loss and τ (tau_est) against step, tokens/s against time, per drafter replica;
                                   the held-out loss and τ of the validation passes (data.validation) dashed
    RUN_DIR/plots/acceptance.png   the evaluation's acceptance-length histogram per drafter (from RUN_DIR/eval.json,
                                   which the demo writes, or --eval FILE: `dflash-eval --json` output)

Read from RUN_DIR/telemetry/metrics.jsonl (one telemetry window a line), so they need neither W&B nor a live job;
launch.sh draws them when a job ends. Matplotlib runs on its Agg backend (no display). Exit status: 0 written;
2 no run directory, no metrics file or an unreadable one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

CONSUMER_METRIC = re.compile(
    r"^consumer/(?P<name>[^/]+)/(?P<key>loss|tau_est|tokens_per_s|step|val_loss|val_tau_est|val_step)$"
)


class PlotError(Exception):
    """A user's mistake (no such run, no metrics): one line, exit 2."""


@dataclass
class Series:
    """One consumer's curves: (step, value) for loss and τ, (seconds since the first window, tokens/s), and
    (step, value) of each validation pass (the held-out curve: one point per pass, at the step it evaluated)."""

    loss: list[tuple[float, float]] = field(default_factory=list)
    tau: list[tuple[float, float]] = field(default_factory=list)
    tokens_per_s: list[tuple[float, float]] = field(default_factory=list)
    val_loss: list[tuple[float, float]] = field(default_factory=list)
    val_tau: list[tuple[float, float]] = field(default_factory=list)

    def add_validation(self, row: dict[str, float]) -> None:
        """A window's validation figures; the gauges repeat in later windows until the next pass: kept once."""
        step = row["val_step"]
        for attr, key in (("val_loss", "val_loss"), ("val_tau", "val_tau_est")):
            points = getattr(self, attr)
            if key in row and (not points or points[-1][0] != step):
                points.append((step, row[key]))


def read_series(metrics_path: Path) -> tuple[dict[str, Series], list[tuple[float, float]]]:
    """(per consumer name, pipeline tokens/s against time) from metrics.jsonl. A torn last line (the writer
    was killed) is skipped; any other line that is not a JSON window is an error naming the line."""
    series: dict[str, Series] = {}
    pipeline: list[tuple[float, float]] = []
    t0 = None
    lines = metrics_path.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise PlotError(f"{metrics_path}:{i + 1}: not a JSON window: {line[:80]!r}") from None
        metrics, t = doc.get("metrics") or {}, doc.get("time")
        if not isinstance(metrics, dict) or not isinstance(t, (int, float)):
            raise PlotError(f"{metrics_path}:{i + 1}: not a telemetry window (no time or metrics)")
        t0 = t if t0 is None else t0
        by_name: dict[str, dict[str, float]] = {}
        for k, v in metrics.items():
            if (m := CONSUMER_METRIC.match(k)) and isinstance(v, (int, float)):
                by_name.setdefault(m["name"], {})[m["key"]] = float(v)
        for name, row in by_name.items():
            s = series.setdefault(name, Series())
            if "step" in row:
                if "loss" in row:
                    s.loss.append((row["step"], row["loss"]))
                if "tau_est" in row:
                    s.tau.append((row["step"], row["tau_est"]))
            if "tokens_per_s" in row:
                s.tokens_per_s.append((t - t0, row["tokens_per_s"]))
            if "val_step" in row:
                s.add_validation(row)
        if isinstance(metrics.get("pipeline/tokens_per_s"), (int, float)):
            pipeline.append((t - t0, float(metrics["pipeline/tokens_per_s"])))
    return series, pipeline


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training(metrics_path: Path, out: Path) -> Path:
    """Three panels, one line per consumer: loss and τ against step (training batches solid, held-out passes
    dashed), tokens/s against time (and the producers' total)."""
    series, pipeline = read_series(metrics_path)
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    held_out = any(s.val_tau for s in series.values())
    panels = (("loss", "loss" + (" (dashed: held-out)" if held_out else ""), "step"),
              ("tau", "τ (tau_est" + ("; dashed: held-out)" if held_out else ", training batches)"), "step"),
              ("tokens_per_s", "tokens/s", "seconds"))  # fmt: skip
    for ax, (attr, title, xlabel) in zip(axes, panels, strict=True):
        for name, s in sorted(series.items()):
            points = getattr(s, attr)
            if points:
                (line,) = ax.plot(*zip(*points, strict=True), label=name, linewidth=1.4)
            val = getattr(s, f"val_{attr}", None)
            if val:
                ax.plot(
                    *zip(*val, strict=True),
                    label=f"{name} held-out",
                    linestyle="--",
                    marker="o",
                    markersize=3,
                    color=line.get_color() if points else None,
                )
        if attr == "tokens_per_s" and pipeline:
            ax.plot(*zip(*pipeline, strict=True), label="producers (total)", color="black", linestyle="--")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "nothing reported yet", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{metrics_path.parent.parent.name}: training ({metrics_path})", fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def read_reports(eval_path: Path) -> dict[str, dict]:
    """{drafter: report} from the demo's eval.json ({name: report}) or one `dflash-eval --json` report."""
    try:
        doc = json.loads(eval_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PlotError(f"{eval_path}: not an evaluation report: {err}") from None
    reports = {"drafter": doc} if isinstance(doc, dict) and "tau_histogram" in doc else doc
    if not isinstance(reports, dict) or not all(
        isinstance(r, dict) and isinstance(r.get("tau_histogram"), list) for r in reports.values()
    ):
        raise PlotError(f"{eval_path}: no tau_histogram in it (expected a dflash-eval report)")
    return reports


def plot_acceptance(eval_path: Path, out: Path) -> Path:
    """One bar chart per drafter: the share of decoding steps that committed k tokens, k = 1..block."""
    reports = read_reports(eval_path)
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(reports), figsize=(5.5 * len(reports), 4), constrained_layout=True,
                             squeeze=False)  # fmt: skip
    for ax, (name, r) in zip(axes[0], sorted(reports.items()), strict=True):
        hist = r["tau_histogram"]
        total = sum(hist) or 1
        ax.bar(range(1, len(hist) + 1), [100 * n / total for n in hist], color="tab:blue")
        ax.set_title(f"{name}: τ {r.get('tau', float('nan')):.2f}, block {r.get('block_size', len(hist))}")
        ax.set_xlabel("tokens committed per step")
        ax.set_ylabel("% of steps")
        ax.set_xticks(range(1, len(hist) + 1))
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"acceptance lengths ({eval_path})", fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_run(run_dir: str | Path, eval_path: str | Path | None = None, out_dir: str | Path | None = None) -> list[Path]:
    """Every picture RUN_DIR has the data for; returns the files written."""
    root = Path(run_dir)
    if not root.is_dir():
        raise PlotError(f"telemetry.plot: run directory {root} does not exist")
    metrics = root / "telemetry" / "metrics.jsonl"
    if not metrics.is_file():
        raise PlotError(f"telemetry.plot: no {metrics}: has this job's telemetry run?")
    out = Path(out_dir) if out_dir else root / "plots"
    written = [plot_training(metrics, out / "training.png")]
    evaluation = Path(eval_path) if eval_path else root / "eval.json"
    if eval_path or evaluation.is_file():
        written.append(plot_acceptance(evaluation, out / "acceptance.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m telemetry.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--eval", help="an evaluation report (default: RUN_DIR/eval.json when present)")
    ap.add_argument("--out", help="folder for the PNG files (default: RUN_DIR/plots)")
    args = ap.parse_args(argv)
    try:
        for path in plot_run(args.run_dir, args.eval, args.out):
            print(f"wrote {path}")
    except PlotError as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
