"""The audit says nothing it cannot prove (issue 36): a folder with no job log is refused, a finished job must be
complete, a drafter the job names must be in the log, and a torn last record (a kill, a full disk) is read up to
it and said."""

import errno
import json
import logging
import os

import pytest

from common.accounting import JobLog, plan_records, read_job_log
from common.accounting_check import main
from common.protocol import DATA_EXHAUSTED
from tests.common.test_accounting import FakeRun


def finished_run(tmp_path, trained: int):
    """A fake run whose one consumer trained seqs 0..trained-1 of 12, saved, and ended on "data exhausted"."""
    run = FakeRun(tmp_path)
    a = run.consumer()
    for s in range(trained):
        a.train(s)
    a.save()
    a.ledger.ended(DATA_EXHAUSTED, 0, a.trainer.step, finished=True)
    a.ledger.close()
    run.producer.close()
    return run


@pytest.mark.parametrize("as_json", [False, True])
@pytest.mark.parametrize("what", ["missing", "file", "empty", "no log"])
def test_the_audit_refuses_a_path_with_no_job_log_in_one_line(tmp_path, capsys, what, as_json):
    path = tmp_path / "run"
    if what == "file":
        path.write_text("x")
    elif what == "empty":
        path.mkdir()
    elif what == "no log":
        (path / "accounting").mkdir(parents=True)
    assert main([str(path), *(["--json"] if as_json else [])]) == 2
    out = capsys.readouterr()
    said = out.out if as_json else out.err
    assert len(said.strip().splitlines()) == 1, said
    if as_json:
        doc = json.loads(said)
        assert doc["ok"] is False and str(path) in doc["error"]
    else:
        assert said.startswith(f"accounting_check: {path}: "), said
    expect = {"missing": "no such folder", "file": "not a folder", "empty": "no job log", "no log": "no job log"}
    assert expect[what] in said


def test_a_logs_from_folder_that_does_not_exist_is_refused(tmp_path, capsys):
    finished_run(tmp_path / "run", 12)
    assert main([str(tmp_path / "run"), "--logs-from", str(tmp_path / "typo")]) == 2
    assert "typo: no such folder" in capsys.readouterr().err


def test_a_finished_job_that_left_batches_untrained_fails_and_names_them(tmp_path, capsys):
    run = finished_run(tmp_path, 10)  # the old loss: the last partial step (seqs 10, 11) never trained
    d0 = run.check().drafters["d0"]
    assert d0.finished and not d0.complete and not d0.ok
    assert d0.errors == [
        f"node 0: the job finished (the producer delivered the whole plan) but {d0.errors[0].split(' but ')[1]}"
    ]
    assert "holds 10 of its 12 batches: seq(s) 10-11 never trained" in d0.errors[0]
    assert main([str(tmp_path)]) == 1
    assert "seq(s) 10-11 never trained" in capsys.readouterr().out


def test_a_finished_complete_job_passes_and_an_unfinished_one_is_not_complete_but_ok(tmp_path, capsys):
    d0 = finished_run(tmp_path / "done", 12).check().drafters["d0"]
    assert d0.finished and d0.complete and d0.ok
    assert main([str(tmp_path / "done")]) == 0
    assert "; complete" in capsys.readouterr().out
    run = FakeRun(tmp_path / "mid")  # stopped part way (its end record says why): in progress, no failure
    a = run.consumer()
    for s in range(5):
        a.train(s)
    a.save()
    a.ledger.ended("stopped by SIGTERM", 0, a.trainer.step, finished=False)
    d0 = run.check().drafters["d0"]
    assert d0.ok and not d0.finished and not d0.complete


def test_a_drafter_the_job_names_without_a_record_in_the_log_fails(tmp_path, capsys):
    run = finished_run(tmp_path, 12)
    (tmp_path / "job.toml").write_text('[[drafters]]\nname = "d0"\n\n[[drafters]]\nname = "d1"\n')
    report = run.check()
    assert report.drafters["d0"].ok and not report.ok
    assert report.drafters["d1"].errors == [
        "the job (job.toml) names this drafter, but the job log has no record of it"
    ]
    assert main([str(tmp_path)]) == 1
    assert "d1: FAILED" in capsys.readouterr().out


def test_a_torn_last_record_is_skipped_and_said_a_torn_middle_one_is_an_error(tmp_path, capsys):
    run = finished_run(tmp_path, 12)
    path = next((tmp_path / "accounting").glob("consumer-*.jsonl"))
    whole, _ = read_job_log(path)
    with open(path, "ab") as f:
        f.write(b'{"kind":"step","drafter":"d0","ra')  # a full disk cut this record's write short
    records, torn = read_job_log(path)
    assert torn and records == whole  # nothing a complete record holds is lost
    report = run.check()
    assert report.ok and report.torn_files == [path.name] and report.torn_lines == 1
    assert report.drafters["d0"].complete
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"note: accounting/{path.name}: its last record is torn (cut mid-line by a kill or a full disk) and"
        " skipped; every complete record before it is read"
    )
    with open(path, "ab") as f:
        f.write(b'\n{"kind":"end","drafter":"d0"}\n')  # written on after the torn one: damage
    with pytest.raises(ValueError, match=rf"{path.name}:\d+: not a JSON record"):
        read_job_log(path)
    assert main([str(tmp_path)]) == 2
    assert "not a JSON record" in capsys.readouterr().err


def test_a_failed_write_closes_the_log_so_a_torn_record_stays_the_last(tmp_path, monkeypatch):
    log = JobLog(tmp_path, "consumer", "d0-r0")
    log.write("start", {"drafter": "d0"})
    real_write = os.write

    def disk_full(fd, data):  # ENOSPC after half the record: what a filling disk does
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(OSError, match="No space left"):
        log.write("step", {"drafter": "d0", "step": 1, "seqs": [0]})
    monkeypatch.setattr(os, "write", real_write)
    with pytest.raises(OSError, match=r"the job log is closed \(a write failed: No space left on device\)"):
        log.write("end", {"drafter": "d0"})  # the disk has room again: nothing is appended after the torn record
    records, torn = read_job_log(log.path)
    assert torn and [r["kind"] for r in records] == ["start"]


def test_a_producer_start_reads_plans_past_a_torn_last_record_and_says_so(tmp_path, caplog):
    run = FakeRun(tmp_path)
    run.deliver(0)
    run.producer.close()
    path = next((tmp_path / "accounting").glob("producer-n0-*.jsonl"))
    with open(path, "ab") as f:
        f.write(b'{"kind":"batch","node":0,"se')
    (tmp_path / "accounting" / "producer-n0-1-ab.jsonl").write_bytes(b'{"kind":"plan","no')  # torn at once
    with caplog.at_level(logging.WARNING, logger="common.accounting"):
        plans = plan_records(tmp_path, 0)
    assert [p["total_batches"] for p in plans] == [12]
    torn_at_once = tmp_path / "accounting" / "producer-n0-1-ab.jsonl"
    assert sorted(r.getMessage() for r in caplog.records) == sorted(
        [
            f"{torn_at_once}: its last record is torn (cut mid-line by a kill or a full disk); it held no whole"
            " record: skipped",
            f"{path}: its last record is torn (cut mid-line by a kill or a full disk); the complete records before"
            " it stand",
        ]
    )
