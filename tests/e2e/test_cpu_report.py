"""`pytest --cpu-log FILE` (tests/conftest.py) and `python -m tests.cpu_report FILE`: the CPU a test's own
processes spend is counted to that test, and the report sums it per file."""

import json
import subprocess
import sys
import textwrap

from tests.cpu_report import main, per_file
from tests.jobs import ROOT

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"


def test_a_tests_child_process_cpu_is_logged_to_that_test_and_summed_per_file(tmp_path, capsys):
    tests = ROOT / "tests" / f"test_zz_cpu_log_probe_{tmp_path.name}.py"  # under tests/: the suite's conftest applies
    tests.write_text(
        textwrap.dedent(
            f"""
            import subprocess, sys

            def test_spawns_a_busy_child():
                subprocess.run([sys.executable, "-c", {BUSY!r}], check=True)

            def test_idle():
                pass
            """
        )
    )
    log = tmp_path / "cpu.jsonl"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), "--cpu-log", str(log)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        tests.unlink()
    assert done.returncode == 0, done.stdout[-2000:]
    rows = {r["test"].split("::")[1]: r for r in map(json.loads, log.read_text().splitlines())}
    assert set(rows) == {"test_spawns_a_busy_child", "test_idle"}
    assert rows["test_spawns_a_busy_child"]["cpu_children"] >= 0.4
    assert rows["test_idle"]["cpu_children"] == 0.0
    name = f"tests/{tests.name}"
    ((count, wall, _own, children),) = per_file(log.read_text().splitlines()).values()
    assert count == 2 and children >= 0.4 and wall >= 0.4
    assert main([str(log)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith(f"    2  {name}") and lines[-1].endswith("2  all 1 files"), lines


def test_a_line_that_is_not_a_record_is_named(tmp_path):
    log = tmp_path / "cpu.jsonl"
    log.write_text('{"test": "a.py::t", "wall": 1, "cpu_self": 1, "cpu_children": 0}\nnot json\n')
    try:
        main([str(log)])
    except SystemExit as err:
        assert str(err).startswith("cpu_report: line 2 is not a --cpu-log record") and "'not json'" in str(err)
    else:
        raise AssertionError("a bad line was not refused")
