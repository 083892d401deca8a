"""The README stays true: its job-file reference is the config models' own, every Python snippet runs as
written, and every message its troubleshooting table quotes is one the code prints."""

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

from common.config_doc import reference

README = Path(__file__).resolve().parents[2] / "README.md"


def test_job_reference_matches_the_config_models():
    text = README.read_text()
    embedded = text.split("<!-- job-reference:begin -->\n")[1].split("\n<!-- job-reference:end -->")[0]
    assert embedded == reference(), "regenerate it: python -m common.config_doc"


def test_readme_names_the_two_setup_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci


def python_snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


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
        exec(compile(snippets[0], "README.md python snippet", "exec"), scope)
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
