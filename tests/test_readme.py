"""The README stays true: its job-file reference is the config models' own."""

from pathlib import Path

from common.config_doc import reference

README = Path(__file__).resolve().parent.parent / "README.md"


def test_job_reference_matches_the_config_models():
    text = README.read_text()
    embedded = text.split("<!-- job-reference:begin -->\n")[1].split("\n<!-- job-reference:end -->")[0]
    assert embedded == reference(), "regenerate it: python -m common.config_doc"


def test_readme_names_the_two_setup_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci
