"""The job log's audit of the held-out records (data.validation), apart from the training plan's.

`common.accounting_check` calls `check_validation` for each drafter and reports the result on its own line.
It proves, from the records alone (common/accounting.py):
  - never trained on: no training batch delivered to the drafter holds a held-out record of its plan (a
    split's held-out ids are in the plan record; a validation file's records are in no plan at all);
  - each whole pass the drafter logged ("evaluation") evaluated every record of one pass exactly once (count
    and digest against the plan record's), and the passes it logged are the ones the producer sent it.
A pass the producer sent and the drafter never finished (a consumer stopped mid-pass) is counted, not an
error: it is not training, and nothing depends on it but one point of the held-out curve.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from common.accounting import DEFAULT_LINEAGE, sample_digest


@dataclass
class ValidationReport:
    held_out: int = 0  # records held out (the newest plan record's)
    pass_samples: int = 0  # records one pass evaluates
    passes_sent: int = 0  # distinct passes the producer sent (part of) to this drafter
    passes_evaluated: int = 0  # whole passes the drafter logged
    passes_exact: int = 0  # of those: every record of the pass once
    passes_mismatched: int = 0
    passes_unfinished: int = 0  # sent, never logged whole
    held_out_trained: int = 0  # held-out records in training batches delivered to this drafter (must be 0)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.passes_mismatched and not self.held_out_trained

    def describe(self) -> str:
        return (
            f"validation: {self.held_out} records held out, {self.passes_exact} of {self.passes_evaluated} passes"
            f" exact ({self.pass_samples} records each), {self.passes_sent} sent, {self.passes_unfinished}"
            f" unfinished, held-out records trained {self.held_out_trained}"
        )


def _lineage(record: dict) -> str:
    return record.get("lineage") or DEFAULT_LINEAGE


def check_validation(drafter: str, records: list[dict]) -> ValidationReport | None:
    """The audit of `drafter`'s held-out records; None when no plan record has any (no data.validation)."""
    plans = {}  # (lineage, node) -> the newest plan record's validation
    for r in sorted((r for r in records if r["kind"] == "plan"), key=lambda r: r["t"]):
        if r.get("validation"):
            plans[_lineage(r), r["node"]] = r["validation"]
    if not plans:
        return None
    rep = ValidationReport()
    newest = next(reversed(plans.values()))
    rep.held_out, rep.pass_samples = int(newest["held_out"]), int(newest["samples"])
    held = {key: set(v.get("held_out_ids") or ()) for key, v in plans.items()}
    trained: set[tuple[str, int, int]] = set()
    sent: set[int] = set()
    for r in records:
        to_me = any(t[0] == drafter for t in r.get("to", ()))
        if r["kind"] == "batch" and to_me:
            ids = held.get((_lineage(r), r["node"]), set())
            trained.update((_lineage(r), r["node"], s) for s in r["samples"] if s in ids)
        elif r["kind"] == "validation" and to_me:
            sent.add(int(r["pass"]))
    rep.held_out_trained = len(trained)
    if trained:
        lineage, node, sample = min(trained)
        rep.errors.append(f"held-out record {sample} (node {node}, lineage {lineage!r}) was delivered for training")
    evaluated: set[int] = set()
    for r in records:
        if r["kind"] != "evaluation" or r.get("drafter") != drafter:
            continue
        plan = plans.get((_lineage(r), 0)) or newest
        rep.passes_evaluated += 1
        evaluated.add(int(r["pass"]))
        counts = Counter(r["samples"])
        if len(counts) == int(plan["samples"]) == len(r["samples"]) and sample_digest(counts) == plan["digest"]:
            rep.passes_exact += 1
        else:
            rep.passes_mismatched += 1
            twice = sum(c - 1 for c in counts.values())
            rep.errors.append(
                f"evaluation pass {r['pass']} (step {r['step']}): {len(counts)} distinct records,"
                f" {twice} evaluated twice; a pass has {plan['samples']} (or another set)"
            )
        if int(r["pass"]) not in sent:
            rep.errors.append(f"evaluation pass {r['pass']} was logged but never sent to {drafter}")
    rep.passes_sent = len(sent)
    rep.passes_unfinished = len(sent - evaluated)
    return rep


def held_out_curve(records: list[dict], drafter: str) -> list[tuple[int, int, float]]:
    """(pass, step, held-out τ) of every pass `drafter` logged, in log order, a repeated pass once."""
    curve: dict[tuple[int, int], float] = {}
    for r in records:
        if r["kind"] == "evaluation" and r.get("drafter") == drafter:
            curve.setdefault((int(r["pass"]), int(r["step"])), float(r["tau"]))
    return [(p, s, tau) for (p, s), tau in curve.items()]
