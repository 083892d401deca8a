"""No role imports another role: producer, consumer and telemetry share only common/, and the demo (which
uses both training roles) is used by no role. Every import statement counts, lazy ones inside functions too."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "producer", "consumer", "telemetry", "demo", "bench", "tests")
ALLOWED = {
    "common": set(),
    "producer": {"common"},
    "consumer": {"common"},
    "telemetry": {"common"},
    "demo": {"common", "producer", "consumer"},
}


def imported_packages(path: Path) -> set[str]:
    """The project's top-level packages that `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES}
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_what_its_layer_allows(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules found in {package}/"
    wrong = {}
    for path in files:
        extra = imported_packages(path) - ALLOWED[package] - {package}
        if extra:
            wrong[str(path.relative_to(ROOT))] = sorted(extra)
    assert not wrong, f"{package}/ may import only {sorted(ALLOWED[package])}: {wrong}"


def test_the_checker_sees_lazy_imports(tmp_path):
    """A late `from consumer.x import y` inside a function is an import like any other."""
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from consumer.evaluate import run_eval\n    import telemetry.nvml\n")
    assert imported_packages(src) == {"consumer", "telemetry"}


def test_producer_package_is_the_target_forward_service_alone():
    names = {p.stem for p in (ROOT / "producer").glob("*.py")}
    assert not names & {"demo", "demo_corpus", "demo_pretrain", "tiny"}, names


def test_every_module_launch_sh_and_the_makefile_run_exists():
    """`python -m X` in launch.sh and the Makefile must name a module that exists (a moved module is not
    left behind in a script only the demo or a make target runs)."""
    import importlib.util
    import re

    for script in ("launch.sh", "Makefile"):
        modules = set(re.findall(r"-m ([A-Za-z_][\w.]*)", (ROOT / script).read_text()))
        assert modules, f"no `-m module` found in {script}"
        missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
        assert not missing, f"{script} runs modules that do not exist: {missing}"
