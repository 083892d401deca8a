"""Check a run's job log (common/accounting.py): did each drafter train every sample once?

    python -m common.accounting_check RUN_DIR [--logs-from OTHER_RUN_DIR ...] [--json]
        exit 0 when every drafter's lineage is exact, 1 when one is not, 2 (one line) when a folder given is
        missing, a file, or holds no job log: an audit of nothing is no pass. A multi-node job without a
        shared run folder passes the other nodes' run folders with --logs-from (their producers' logs;
        checkpoints are node 0's)

For each drafter: start from the checkpoint `latest` points at, read the ledger id it carries, walk the
chain of checkpoint records back to a fresh start and collect the seqs trained along it. Then:
  - duplicates: a seq trained twice in the lineage, or a sample trained twice within one epoch;
  - missing: a seq below its producer's final cursor that the lineage never trained (its samples were lost;
    the cursors are per node and producer: producer p of R makes the node's seqs ≡ p mod R);
  - every seq in the lineage was delivered by the producer to this drafter, always with the same samples;
  - every epoch the lineage covers entirely holds exactly the plan's sample set (count and digest);
  - crash losses: steps that crashed incarnations trained after their last checkpoint; each must be in the
    lineage exactly once (trained again after resume);
  - the held-out records (data.validation), audited on their own (common/accounting_validation.py): never
    in a training batch, every record once in each evaluation pass;
  - a finished job is complete: when the process that wrote the final checkpoint ended with the whole plan
    delivered to its group (its "end" record), every batch of the plan is in the lineage; the seqs that are
    not are named;
  - every drafter the run folder's job.toml names has records in the job log.
A job-log file whose last record is torn (a kill or a full disk) is read up to it and named on a "note:" line.
Data lineages (common/accounting.py): the chain is cut where its checkpoint records change lineage, and each
part is checked as above against its own lineage's plan and deliveries. A node's plan records of one lineage
must agree on every input but `epochs`, and epoch by epoch on the epochs they share: a plan that grew by
epochs (data.epochs raised) is checked as its longest version, "complete" against its newest.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from common.accounting import (
    ACCOUNTING_DIR,
    DEFAULT_LINEAGE,
    ledger_id_of,
    per_node,
    read_job_log,
    sample_digest,
)
from common.accounting_validation import ValidationReport, check_validation
from common.checkpoint_pointer import read_pointer
from common.run_paths import RunPaths

STATE_FILE = "trainer_state.pt"


@dataclass
class LineageReport:
    """One data lineage of a drafter's chain."""

    lineage: str
    trained_batches: int = 0
    epochs_complete: int = 0
    epochs_planned: list[int] = field(default_factory=list)  # epoch counts of its plan records, oldest first
    complete: bool = False

    def describe(self) -> str:
        planned = self.epochs_planned
        counts = [n for i, n in enumerate(planned) if i == 0 or planned[i - 1] != n]  # each change once
        steps = " → ".join(map(str, counts))
        if len(counts) <= 1:
            plan = f"{steps or 'no'} epoch(s) planned"
        elif counts == sorted(counts):
            plan = f"plan grew by epochs {steps} (the epochs they share are equal)"
        else:
            plan = f"epochs changed {steps}"
        return (
            f"lineage {self.lineage!r}: {self.trained_batches} batches, {self.epochs_complete} whole epochs"
            f" verified, {plan}{'; complete' if self.complete else ''}"
        )


@dataclass
class DrafterReport:
    drafter: str
    final_checkpoint: str | None = None
    final_step: int = 0
    lineage_checkpoints: int = 0
    trained_batches: int = 0
    duplicate_batches: int = 0
    duplicate_samples: int = 0
    missing_batches: int = 0
    lost_samples: int = 0
    undelivered_batches: int = 0  # trained, but the producer's log has no such delivery to this drafter
    epochs_complete: int = 0  # epochs whose every seq is in the lineage: checked against the plan's sample set
    epochs_mismatched: int = 0
    complete: bool = False  # the lineage reaches the end of the plan on every node
    finished: bool = False  # the process that wrote the final checkpoint ended with the whole plan delivered
    crash_lost_batches: int = 0  # trained by incarnations after their last checkpoint, lost with them
    crash_lost_retrained: int = 0  # of those, trained (once) in the final lineage
    lineages: list[LineageReport] = field(default_factory=list)  # the data lineages of the chain, oldest first
    validation: ValidationReport | None = None  # the held-out records' audit (None: no data.validation)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        if self.validation is not None and not self.validation.ok:
            return False
        return not self.errors and not (
            self.duplicate_batches
            or self.duplicate_samples
            or self.missing_batches
            or self.lost_samples
            or self.undelivered_batches
            or self.epochs_mismatched
        )


@dataclass
class AccountingReport:
    drafters: dict[str, DrafterReport]
    records: int
    torn_lines: int  # a last record cut short by a kill or a full disk: skipped
    errors: list[str] = field(default_factory=list)
    torn_files: list[str] = field(default_factory=list)  # the job-log files that end in a torn record

    @property
    def ok(self) -> bool:
        return not self.errors and all(d.ok for d in self.drafters.values())

    @property
    def duplicates(self) -> int:
        return sum(d.duplicate_batches + d.duplicate_samples for d in self.drafters.values())

    @property
    def lost_samples(self) -> int:
        return sum(d.lost_samples for d in self.drafters.values())

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "records": self.records,
            "torn_lines": self.torn_lines,
            "torn_files": self.torn_files,
            "errors": self.errors,
            "duplicates": self.duplicates,
            "lost_samples": self.lost_samples,
            "drafters": {k: {**asdict(v), "ok": v.ok} for k, v in self.drafters.items()},
        }


def read_records(run_dirs: list[Path]) -> tuple[list[dict], list[str]]:
    """Every record of every incarnation, each tagged with its file ("src"), and the files whose last record is
    torn (skipped: common/accounting.py `read_job_log`)."""
    records, torn = [], []
    for path in sorted(p for d in run_dirs for p in (d / ACCOUNTING_DIR).glob("*.jsonl")):
        recs, cut = read_job_log(path)
        for rec in recs:
            rec["src"] = path.name
        records.extend(recs)
        if cut:
            torn.append(path.name)
    return records, torn


class NotARun(ValueError):
    """The path given is no run folder with a job log: nothing to check, which is no pass."""


def check_folder(path: Path) -> None:
    """NotARun unless `path` is a folder holding a job log (accounting/*.jsonl)."""
    if not path.exists():
        raise NotARun(f"{path}: no such folder (name the job's run folder, job.run_dir)")
    if not path.is_dir():
        raise NotARun(f"{path}: not a folder (name the job's run folder, job.run_dir)")
    if not any((path / ACCOUNTING_DIR).glob("*.jsonl")):
        raise NotARun(f"{path}: no job log ({ACCOUNTING_DIR}/*.jsonl): not a run folder, or a job that never started")


def job_drafters(run_dir: Path) -> list[str]:
    """The drafters the run folder's job file (job.toml, the producer's copy) names; [] without one."""
    path = RunPaths(run_dir).job_copy
    if not path.is_file():
        return []
    try:
        doc = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a readable job file: {err}") from None
    return [d["name"] for d in doc.get("drafters", []) if isinstance(d, dict) and isinstance(d.get("name"), str)]


def final_ledger_id(ckpt_root: Path) -> tuple[str | None, int, str | None]:
    """(ledger id, step, checkpoint name) of the checkpoint `latest` points at; (None, 0, None) if none."""
    name = read_pointer(ckpt_root)
    if name is None:
        return None, 0, None
    state = torch.load(ckpt_root / name / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    return ledger_id_of(state), int(state["step"]), name


def check_run(run_dir: str | Path, logs_from: list[str | Path] = ()) -> AccountingReport:
    """Check the run in `run_dir` (its checkpoints and job log), adding the job logs found in `logs_from`."""
    run_dir = Path(run_dir)
    dirs = [run_dir, *map(Path, logs_from)]
    for d in dirs:
        check_folder(d)
    records, torn = read_records(dirs)
    report = AccountingReport({}, len(records), len(torn), torn_files=torn)
    plans = _plans(records, report.errors)
    deliveries = _deliveries(records, report.errors)
    logged = {r["drafter"] for r in records if r["kind"] in ("start", "checkpoint")}
    named = job_drafters(run_dir)
    drafters = sorted(logged | set(named) | {p.name for p in (run_dir / "checkpoints").glob("*") if p.is_dir()})
    for drafter in drafters:
        if drafter not in logged and drafter in named:  # never started, or its log was lost: nothing proves it
            report.drafters[drafter] = DrafterReport(
                drafter, errors=["the job (job.toml) names this drafter, but the job log has no record of it"]
            )
            continue
        report.drafters[drafter] = _check_drafter(run_dir, drafter, records, plans, deliveries)
        report.drafters[drafter].validation = check_validation(drafter, records)
    return report


def _lineage(record: dict) -> str:
    return record.get("lineage") or DEFAULT_LINEAGE


PLAN_KEYS = ("samples", "digest")


def _plans(records: list[dict], errors: list[str]) -> dict[tuple[str, int], dict]:
    """(lineage, node) -> its plan: the longest epoch list its records logged ("epochs"), the newest record's
    total ("latest_total") and every record's epoch count ("epochs_planned"). Records of one lineage that
    differ in anything but the number of epochs are an error: a changed plan was resumed."""
    plans: dict[tuple[str, int], dict] = {}
    for r in sorted((r for r in records if r["kind"] == "plan"), key=lambda r: r["t"]):
        key = (_lineage(r), r["node"])
        plan = plans.get(key)
        if plan is None:
            plans[key] = {
                **{k: r[k] for k in PLAN_KEYS},
                "epochs": list(r["epochs"]),
                "fingerprint": r.get("fingerprint"),
                "latest_total": r["total_batches"],
                "epochs_planned": [len(r["epochs"])],
            }
            continue
        shared = min(len(plan["epochs"]), len(r["epochs"]))
        fp_old, fp_new = plan["fingerprint"], r.get("fingerprint")
        changed = [k for k in PLAN_KEYS if plan[k] != r[k]]
        if plan["epochs"][:shared] != r["epochs"][:shared]:
            changed.append("the batches of the epochs both plans have")
        if fp_old is not None and fp_new is not None:
            changed += [k for k in fp_new if k != "data_path" and fp_old.get(k) != fp_new.get(k)]
        if changed:
            errors.append(
                f"node {r['node']} lineage {key[0]!r}: producer incarnations logged different plans"
                f" ({r['src']}: {', '.join(dict.fromkeys(changed))} changed): a changed plan was resumed"
            )
        if len(r["epochs"]) > len(plan["epochs"]):
            plan["epochs"] = list(r["epochs"])
        plan["fingerprint"] = fp_new or fp_old
        plan["latest_total"] = r["total_batches"]
        plan["epochs_planned"].append(len(r["epochs"]))
    return plans


def _deliveries(records: list[dict], errors: list[str]) -> dict[tuple[str, int, int], tuple[int, tuple, set[str]]]:
    """(lineage, node, seq) -> (epoch, samples, drafters it went to); a seq re-sent with other samples is an error."""
    out: dict[tuple[str, int, int], tuple[int, tuple, set[str]]] = {}
    for r in records:
        if r["kind"] != "batch":
            continue
        key, samples = (_lineage(r), r["node"], r["seq"]), tuple(r["samples"])
        prev = out.get(key)
        if prev is not None and (prev[0], prev[1]) != (r["epoch"], samples):
            errors.append(f"node {r['node']} seq {r['seq']}: delivered twice with different samples")
        drafters = prev[2] if prev else set()
        drafters.update(to[0] for to in r["to"])
        out[key] = (r["epoch"], samples, drafters)
    return out


def _check_drafter(
    run_dir: Path, drafter: str, records: list[dict], plans: dict[tuple[str, int], dict], deliveries: dict
) -> DrafterReport:
    rep = DrafterReport(drafter)
    mine = [r for r in records if r.get("drafter") == drafter]
    by_id = {r["id"]: r for r in mine if r["kind"] == "checkpoint"}
    try:
        final_id, rep.final_step, rep.final_checkpoint = final_ledger_id(run_dir / "checkpoints" / drafter)
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        rep.errors.append(f"cannot read the final checkpoint: {err}")
        return rep
    if rep.final_checkpoint is not None and final_id is None:
        rep.errors.append(f"{rep.final_checkpoint} carries no ledger id: it was written without accounting")
        return rep
    chain, seen = [], set()  # the final checkpoint's lineage of checkpoint records, newest first
    rid = final_id
    while rid is not None:
        rec = by_id.get(rid)
        if rec is None or rid in seen:
            rep.errors.append(f"lineage broken: no checkpoint record {rid!r}" if rec is None else f"cycle at {rid}")
            return rep
        seen.add(rid)
        chain.append(rec)
        rid = rec["parent"]
    rep.lineage_checkpoints = len(chain)
    parts: list[tuple[str, list[dict]]] = []  # the chain cut by data lineage, oldest first
    for rec in reversed(chain):
        if parts and parts[-1][0] == _lineage(rec):
            parts[-1][1].append(rec)
        elif any(name == _lineage(rec) for name, _ in parts):
            rep.errors.append(
                f"lineage {_lineage(rec)!r} resumed after {parts[-1][0]!r} ({rec['id']}): its cursor was gone"
            )
            return rep
        else:
            parts.append((_lineage(rec), [rec]))
    in_chain: Counter = Counter()
    node_seqs: dict[int, list[int]] = {}
    for name, recs in parts:
        node_seqs = defaultdict(list)
        for rec in recs:
            for node, seqs in rec["trained"].items():
                node_seqs[int(node)].extend(seqs)
        cursors = _final_cursors(recs[-1])
        first_plan = next((p for (ln, _), p in sorted(plans.items()) if ln == name), None)  # the lowest node's
        part = LineageReport(name, epochs_planned=list(first_plan["epochs_planned"]) if first_plan else [])
        part.complete = bool(cursors) and all(
            (name, n) in plans and min(c) >= plans[name, n]["latest_total"] for n, c in cursors.items()
        )
        before = (rep.trained_batches, rep.epochs_complete)
        for node, seqs in sorted(node_seqs.items()):
            _check_node(rep, drafter, node, seqs, cursors.get(node, ()), plans.get((name, node)), deliveries, name)
        part.trained_batches = rep.trained_batches - before[0]
        part.epochs_complete = rep.epochs_complete - before[1]
        rep.lineages.append(part)
        in_chain.update((name, s) for seqs in node_seqs.values() for s in seqs)
    rep.complete = bool(rep.lineages) and rep.lineages[-1].complete
    _check_crash_losses(rep, mine, in_chain)
    if chain:
        _check_finished(rep, mine, chain[0], node_seqs, plans)
    return rep


def _check_finished(
    rep: DrafterReport, mine: list[dict], final: dict, node_seqs: dict[int, list[int]], plans: dict
) -> None:
    """A job is finished when the process that wrote the final checkpoint record ended with the whole plan
    delivered to its group (its "end" record): then its lineage must be complete, every batch of the plan
    trained (`node_seqs`: the last lineage part's seqs per node); what is not is named."""
    rep.finished = any(r["kind"] == "end" and r["src"] == final["src"] and r.get("finished") for r in mine)
    if not rep.finished or rep.complete:
        return
    name = _lineage(final)
    for node in sorted(_final_cursors(final)):
        plan = plans.get((name, node))
        if plan is None:
            continue  # said already: no plan record
        trained = set(node_seqs.get(node, ()))
        left = [s for s in range(plan["latest_total"]) if s not in trained]
        if left:
            rep.errors.append(
                f"node {node}: the job finished (the producer delivered the whole plan) but {final['id']} holds"
                f" {len(trained)} of its {plan['latest_total']} batches: seq(s) {_span(left)} never trained"
            )


def _span(seqs: list[int]) -> str:
    """Sorted seqs as short ranges: 3, 5-9, 12."""
    out, start = [], None
    for i, s in enumerate(seqs):
        if start is None:
            start = s
        if i + 1 == len(seqs) or seqs[i + 1] != s + 1:
            out.append(f"{start}" if start == s else f"{start}-{s}")
            start = None
    return ", ".join(out[:8]) + (f", ... ({len(out) - 8} more ranges)" if len(out) > 8 else "")


def _final_cursors(record: dict) -> dict[int, tuple[int, ...]]:
    """{node: (cursor of producer 0, 1, ...)} from a checkpoint record (flat per node and producer)."""
    return dict(enumerate(per_node(record["cursors"], record.get("producers", 1))))


def _check_node(
    rep: DrafterReport,
    drafter: str,
    node: int,
    seqs: list[int],
    cursors: tuple[int, ...],
    plan: dict | None,
    deliveries: dict,
    lineage: str = DEFAULT_LINEAGE,
) -> None:
    """`cursors`: the node's final cursor per producer (producer p's seqs are ≡ p mod len(cursors)), in
    data lineage `lineage`."""
    counts = Counter(seqs)
    rep.trained_batches += len(seqs)
    rep.duplicate_batches += sum(c - 1 for c in counts.values() if c > 1)
    missing = [s for p, c in enumerate(cursors) for s in range(p, c, len(cursors)) if s not in counts]
    rep.missing_batches += len(missing)
    for s in missing:
        got = deliveries.get((lineage, node, s))
        rep.lost_samples += len(got[1]) if got else 1  # never delivered: at least one sample
    if plan is None:
        rep.errors.append(f"node {node}: no plan record from its producer (lineage {lineage!r})")
        return
    per_epoch: dict[int, Counter] = defaultdict(Counter)
    for s, times in counts.items():
        got = deliveries.get((lineage, node, s))
        if got is None or drafter not in got[2]:
            rep.undelivered_batches += 1
            continue
        per_epoch[got[0]].update(dict.fromkeys(got[1], times))
    for e in plan["epochs"]:
        samples = per_epoch.get(e["epoch"], Counter())
        rep.duplicate_samples += sum(c - 1 for c in samples.values() if c > 1)
        span = range(e["first_seq"], e["first_seq"] + e["batches"])
        if all(s in counts for s in span):
            rep.epochs_complete += 1
            if len(samples) != plan["samples"] or sample_digest(samples) != plan["digest"]:
                rep.epochs_mismatched += 1
                rep.errors.append(
                    f"node {node} lineage {lineage!r} epoch {e['epoch']}: {len(samples)} distinct"
                    f" samples trained, the plan has {plan['samples']} (or another set)"
                )


def _check_crash_losses(rep: DrafterReport, mine: list[dict], in_chain: Counter) -> None:
    """Steps an incarnation trained after its last successful save, when it did not end cleanly; `in_chain`
    counts the chain's (lineage, seq)s. An incarnation's steps are in the lineage its start record names."""
    by_src: dict[str, list[dict]] = defaultdict(list)
    for r in mine:
        by_src[r["src"]].append(r)
    for recs in by_src.values():
        name = next((_lineage(r) for r in recs if r["kind"] == "start"), DEFAULT_LINEAGE)
        saved = max((r["step"] for r in recs if r["kind"] == "saved"), default=-1)
        lost = [s for r in recs if r["kind"] == "step" and r["step"] > saved for s in r["seqs"]]
        rep.crash_lost_batches += len(lost)
        rep.crash_lost_retrained += sum(in_chain[name, s] == 1 for s in lost)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.accounting_check", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument(
        "--logs-from",
        nargs="*",
        default=[],
        metavar="RUN_DIR",
        help="other nodes' run folders whose job logs belong to this job",
    )
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = ap.parse_args(argv)
    try:
        report = check_run(args.run_dir, args.logs_from)
    except NotARun as err:  # nothing to check is no pass
        return _refuse(str(err), args.json)
    except (OSError, ValueError) as err:
        return _refuse(f"{args.run_dir}: {err}", args.json)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        for name in report.torn_files:
            print(
                f"note: {ACCOUNTING_DIR}/{name}: its last record is torn (cut mid-line by a kill or a full disk)"
                " and skipped; every complete record before it is read"
            )
        for d in report.drafters.values():
            state = "ok" if d.ok else "FAILED"
            print(
                f"{d.drafter}: {state}: {d.trained_batches} batches in {d.lineage_checkpoints} checkpoints up to"
                f" {d.final_checkpoint}, {d.epochs_complete} whole epochs verified, duplicates"
                f" {d.duplicate_batches}/{d.duplicate_samples} (batches/samples), missing {d.missing_batches},"
                f" lost samples {d.lost_samples}, undelivered {d.undelivered_batches}, epochs mismatched"
                f" {d.epochs_mismatched}, lost in crashes {d.crash_lost_batches} (retrained"
                f" {d.crash_lost_retrained}){'; complete' if d.complete else ''}"
            )
            if len(d.lineages) > 1 or any(len(set(p.epochs_planned)) > 1 for p in d.lineages):
                for part in d.lineages:
                    print(f"    {part.describe()}")
            if d.validation is not None:
                print(f"    {d.validation.describe()}{'' if d.validation.ok else ': FAILED'}")
                for e in d.validation.errors:
                    print(f"    {e}")
            for e in d.errors:
                print(f"    {e}")
        for e in report.errors:
            print(f"error: {e}")
    return 0 if report.ok else 1


def _refuse(message: str, as_json: bool) -> int:
    """One line (a JSON object with --json) and exit 2: the audit could not run."""
    if as_json:
        print(json.dumps({"ok": False, "error": message}))
    else:
        print(f"accounting_check: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
