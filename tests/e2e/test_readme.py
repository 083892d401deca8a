"""The README and the user pages it hands on to (docs/) stay true: the job-file reference is the config models'
own, every Python snippet runs as written, every command they show runs in a fresh clone, and the README stays a
newcomer's page whose every link leads somewhere."""

import contextlib
import importlib.util
import io
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.config_doc import reference

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The design pages name modules in prose (`python -m common.accounting_check`), for readers of the code; every
# other page, a new one included, is a user's page whose commands are pasted as written, like the README's.
DESIGN_PAGES = {"design.md", "architecture.md", "gpu.md", "scaling.md", "reliability.md", "security.md"}
USER_PAGES = [README, *sorted(p for p in DOCS.glob("*.md") if p.name not in DESIGN_PAGES)]
README_MAX_LINES = 300


def test_job_reference_matches_the_config_models():
    text = (DOCS / "training.md").read_text()
    embedded = text.split("<!-- job-reference:begin -->\n")[1].split("\n<!-- job-reference:end -->")[0]
    assert embedded == reference(), "regenerate it: python -m common.config_doc"


def test_readme_names_the_two_setup_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci


def python_snippets() -> list[str]:
    return [s for p in USER_PAGES for s in re.findall(r"^```python\n(.*?)^```", p.read_text(), flags=re.S | re.M)]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A folder laid out as after `make demo` (quick assets, a random b16 drafter at checkpoints/d_b16/latest)."""
    import demo.job as demo
    from common.checkpoint_pointer import write_pointer
    from common.config import load_job
    from consumer.export.layout import export_config, write_export
    from consumer.model import DFlashDrafter, DrafterArch
    from consumer.target_parts import load_target_parts

    cwd = tmp_path_factory.mktemp("user")
    job = load_job(demo.prepare_demo(cwd / "runs" / "demo", quick=True))
    parts = load_target_parts(job.target.path)
    d = next(d for d in job.drafters if d.name == "d_b16")
    torch.manual_seed(0)
    arch = DrafterArch.from_target(parts, d, len(job.target.layer_ids))
    export = job.run_paths.checkpoints(d.name) / "step_1"
    export.mkdir(parents=True)
    cfg = export_config(arch, parts, block_size=d.block_size, mask_token_id=parts.vocab_size - 1,
                        target_layer_ids=list(job.target.layer_ids), dtype="float32")  # fmt: skip
    write_export(export, DFlashDrafter(arch, parts.embed_tokens, parts.lm_head).state_dict(), cfg)
    write_pointer(export.parent, export.name)
    return cwd


def test_every_python_snippet_runs_as_written(demo_run, monkeypatch):
    snippets = python_snippets()
    assert len(snippets) == 1 and "spec_generate" in snippets[0]
    monkeypatch.chdir(demo_run)
    scope: dict = {"__name__": "__readme__"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippets[0], "docs/evaluation.md python snippet", "exec"), scope)
    # what it printed is the target's own greedy answer, and the steps commit every new token
    ids, out, target, tok = scope["ids"], scope["out"], scope["target"], scope["tokenizer"]
    greedy = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    assert out.tolist() == greedy.tolist()
    new = out.shape[1] - ids.shape[1]
    assert new > 1 and sum(scope["draft"].acceptance_lengths) == new - 1  # the first comes from the prefill
    assert printed.getvalue() == (
        f"{tok.decode(out[0, ids.shape[1] :])}\ntokens committed per step: {scope['draft'].acceptance_lengths}\n"
    )


PROJECT_PACKAGES = ("bench", "common", "consumer", "evaluation", "producer", "telemetry", "demo")


def readme_commands() -> list[str]:
    """What a reader may paste from the README and the user pages: every line of a ```bash block and every inline
    code span (texts that are not commands are filtered by the rules below, which look only at a command's first
    words)."""
    return [c for page in USER_PAGES for c in page_commands(page.read_text())]


FENCE = r"^([ \t]*)```(\w*)\n(.*?)^\1```"  # a fenced block, also one indented under a list item


def page_commands(text: str) -> list[str]:
    """A bash block's lines (continuation lines, indented past the block's own indent, belong to the line above)
    and every inline code span, one wrapped over lines included."""
    lines = [
        ln.strip()
        for indent, lang, body in re.findall(FENCE, text, flags=re.S | re.M)
        if lang == "bash"
        for ln in body.splitlines()
        if ln.strip() and not ln.removeprefix(indent).startswith((" ", "\t"))
    ]
    spans = re.findall(r"`([^`]+)`", re.sub(FENCE, "", text, flags=re.S | re.M))
    return lines + [" ".join(s.split()) for s in spans]


def command_problem(cmd: str, scripts: set[str], make_targets: set[str]) -> str | None:
    """Why `cmd` would not run as written in a fresh clone after `make install`, or None. The project's own
    tools live in .venv/bin (not on PATH): `python -m <project module>` or `dflash-x ARGS` must name it."""
    cmd = re.sub(r"^(\w+=\S*\s+)+", "", cmd)  # leading environment assignments: OMP_NUM_THREADS=1 python ...
    words = cmd.split()
    if re.match(rf"python3? -m ({'|'.join(PROJECT_PACKAGES)})\b", cmd):
        return "the system python has none of the project's dependencies: write .venv/bin/python"
    if words[0] in scripts and len(words) > 1 and not words[0].endswith(":"):
        return f"{words[0]} is not on PATH after `make install`: write .venv/bin/{words[0]}"
    if words[0].startswith(".venv/bin/"):
        tool = words[0].removeprefix(".venv/bin/")
        if tool == "python" and words[1:2] == ["-m"]:
            module = words[2]
            if module.split(".")[0] not in PROJECT_PACKAGES:
                return f"{module} is not a project module"
            if not re.search(r"[A-Z]", module) and importlib.util.find_spec(module) is None:
                return f"no module {module}"
        elif tool != "python" and tool not in scripts:
            return f"make install puts no {tool} in .venv/bin (pyproject's [project.scripts]: {sorted(scripts)})"
    if words[0] == "make" and len(words) > 1 and not words[1].startswith("#") and words[1] not in make_targets:
        return f"the Makefile has no target {words[1]}"
    if words[0].startswith("./") and not (README.parent / words[0]).exists():
        return f"{words[0]} is not in the repository"
    return None


def test_every_readme_command_runs_as_written_on_a_fresh_clone():
    """`dflash-stats runs/demo` gave `command not found`: .venv/bin is not on PATH, so a command of the project
    names its .venv/bin path (or is a make target, or ./launch.sh)."""
    scripts = set(tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["scripts"])
    make_targets = set(re.findall(r"^([\w-]+):", (README.parent / "Makefile").read_text(), flags=re.M))
    commands = readme_commands()
    assert ".venv/bin/dflash-stats runs/demo" in page_commands(README.read_text())
    assert {"make demo", "make lock", ".venv/bin/python -m producer data-stats job.toml"} <= set(commands)
    assert "vllm serve /models/qwen3-8b --port 8000                                    # or:" in commands  # indented
    assert "OMP_NUM_THREADS=1 .venv/bin/python -m bench.drafter --quick --vocab 151936 --no-short" in commands
    assert [p.name for p in USER_PAGES if not page_commands(p.read_text())] == []  # each page is read
    wrong = {c: p for c in commands if (p := command_problem(c, scripts, make_targets))}
    assert not wrong, wrong
    # the rules catch what a fresh clone trips on
    assert command_problem("dflash-stats runs/demo", scripts, make_targets)
    assert command_problem("python -m bench.soak --json", scripts, make_targets)
    assert command_problem("OMP_NUM_THREADS=1 python -m bench.drafter", scripts, make_targets)
    assert command_problem(".venv/bin/dflash-nothing x", scripts, make_targets)
    assert command_problem("make nothing", scripts, make_targets)
    assert command_problem("dflash-stats: no telemetry socket at …", scripts, make_targets) is None  # a message


def test_the_readme_is_a_newcomers_page_and_the_docs_index_lists_every_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move a section into docs/"
    index = (DOCS / "README.md").read_text()
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages <= listed, f"docs/README.md does not link {sorted(pages - listed)}"
    assert "docs/README.md" in {t for _, t in links(README.read_text())}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (code marks too), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> Iterator[str]:
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        yield base if n == 0 else f"{base}-{n}"


def links(text: str) -> list[tuple[str, str]]:
    """(label, target) of every Markdown link outside code."""
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    return re.findall(r"\[([^\]]*)\]\(([^)\s]+)\)", prose)


def broken_links(page: Path) -> list[str]:
    wrong = []
    for _, target in links(page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # https://, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            wrong.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in set(anchors(dest.read_text())):
            wrong.append(f"{target}: {dest.name} has no heading with anchor #{anchor}")
    return wrong


def test_every_relative_link_of_the_readme_and_docs_resolves():
    pages = [README, *DOCS.glob("*.md")]
    wrong = {p.name: b for p in pages if (b := broken_links(p))}
    assert not wrong, wrong
    assert sum(len(links(p.read_text())) for p in pages) > 40  # the pages are read
    # the check catches a moved page and a renamed section
    assert slug("Worked example: Qwen3.6-27B on 8 GPUs") == "worked-example-qwen36-27b-on-8-gpus"
    assert slug('DFlash2 (`arch = "dflash2"` in a `[[drafters]]` table)') == "dflash2-arch--dflash2-in-a-drafters-table"
    assert list(anchors("# A\n```\n# B\n```\n## A\n")) == ["a", "a-1"]


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "there.md").write_text("# Here it is\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#here-it-is) [gone](missing.md) [moved](there.md#elsewhere) `[no](code.md)`\n")
    assert broken_links(page) == [
        "missing.md: no such file",
        "there.md#elsewhere: there.md has no heading with anchor #elsewhere",
    ]
