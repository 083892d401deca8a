"""No role imports another role: producer, consumer and telemetry share only common/; evaluation/ builds on
consumer/'s drafters and no role imports it; the demo (which uses both training roles and evaluation) is used by
no role. Every import statement counts, lazy ones inside functions too."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "producer", "consumer", "evaluation", "telemetry", "demo", "bench", "tests")
ALLOWED = {
    "common": set(),
    "producer": {"common"},
    "consumer": {"common"},
    "evaluation": {"common", "consumer"},  # decodes with the drafters consumer/ trains and exports
    "telemetry": {"common"},
    "demo": {"common", "producer", "consumer", "evaluation"},
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
    src.write_text("import os\n\ndef f():\n    from evaluation.evaluate import run_eval\n    import telemetry.nvml\n")
    assert imported_packages(src) == {"evaluation", "telemetry"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports: every import statement, lazy and TYPE_CHECKING ones too (a
    circle through a type annotation still ties two modules together). `from pkg import mod` names pkg.mod."""
    modules = {module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + "."):  # a package's own __init__ is no edge back
                    found.add(t)
        graph[name] = found
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_no_module_imports_itself_through_others():
    """No import circle between the project's modules (tests and bench included): each module can be read, and
    imported, before the ones that use it."""
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    graph = import_graph(files)
    assert len(graph) > 200 and graph["evaluation.cli"] >= {"evaluation.evaluate", "evaluation.benchmarks"}
    assert import_circles(graph) == []


def test_the_circle_finder_sees_a_circle_through_a_lazy_or_type_only_import(tmp_path, monkeypatch):
    pkg = tmp_path / "common"
    pkg.mkdir()
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from common.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from common import a\n")
    (pkg / "c.py").write_text("import common.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph(sorted(pkg.glob("*.py")))
    assert graph == {"common.a": {"common.b"}, "common.b": {"common.a"}, "common.c": {"common.a"}}
    assert import_circles(graph) == [["common.a", "common.b"]]


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


# ------------------------------------------------------------------------------------ builders (issue 23)
BUILDERS = {"ProducerService": "producer/build.py", "ConsumerService": "consumer/build.py"}
# tests of the service classes themselves (a ring refused, a second producer of one job, the resume seqs)
SERVICE_CLASS_TESTS = {
    "tests/producer/test_faults_producer.py",
    "tests/producer/test_producer_startup.py",
    "tests/consumer/test_group_cursor.py",
    "tests/consumer/test_validation.py",
}  # the best-checkpoint hook of the loop itself


def wiring_problems(path: Path) -> list[str]:
    """How `path` reaches around the builders: a service constructed by hand, or anything but `main` taken
    from an entry script (`producer.__main__`, `consumer.__main__`)."""
    text = path.read_text()
    if "Service(" not in text and "__main__" not in text:
        return []  # neither can occur: spare the parse
    tree = ast.parse(text, filename=str(path))
    found, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith(".__main__"):
            found += [f"imports {node.module}.{a.name}" for a in node.names if a.name != "main"]
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name.endswith(".__main__")}
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in BUILDERS:
                found.append(f"constructs {name} (build it with {BUILDERS[name]})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in aliases and node.attr != "main":
            found.append(f"uses {ast.unparse(node.value)}.{node.attr}")
    return found


def test_bench_tests_and_entry_scripts_build_services_through_the_builders():
    """Production, bench and tests assemble a producer or consumer through producer/build.py and
    consumer/build.py alone, so a change there reaches all three; the tests of the service classes
    themselves (SERVICE_CLASS_TESTS) may construct them."""
    wrong = {}
    for package in ("producer", "consumer", "bench", "tests", "demo"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in BUILDERS.values() or rel in SERVICE_CLASS_TESTS or rel == "tests/e2e/test_layering.py":
                continue
            if problems := wiring_problems(path):
                wrong[rel] = problems
    assert not wrong, f"assembled by hand, not through the builders: {wrong}"


def test_the_wiring_checker_sees_private_wiring_and_hand_built_services(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import consumer.__main__ as cm\nfrom producer.__main__ import main, _load\n"
        "def f(job):\n    cm.main([])\n    cm._serve(job)\n    return ProducerService(job)\n"
    )
    assert sorted(wiring_problems(src)) == [
        "constructs ProducerService (build it with producer/build.py)",
        "imports producer.__main__._load",
        "uses cm._serve",
    ]


def test_the_tree_is_formatted_and_lint_clean():
    """`make lint` in the suite (CI runs the suite): ruff's formatter layout (line length 120, pyproject.toml)
    and its lint rules hold over the whole tree, so a change cannot land unformatted."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a dev dependency (pyproject.toml): `make install` puts it next to python"
    for args in (["format", "--check", "."], ["check", "."]):
        run = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, f"ruff {' '.join(args)}:\n{run.stdout[-3000:]}{run.stderr[-1000:]}"
