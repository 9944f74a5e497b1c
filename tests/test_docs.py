"""The docs site: generated reference pages are current, every config key and option is
described, and what other tests read from the docs is where they look for it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import Field, create_model

from conftest import REPO

sys.path.insert(0, str(REPO))  # tools/ is not installed: it is run from a checkout

from tools import docgen  # noqa: E402

from ckptd import config  # noqa: E402


def test_the_generated_reference_pages_are_current():
    """`python -m tools.docgen` writes them; run it after changing a model or the parser."""
    assert docgen.stale() == []


@pytest.mark.parametrize("rel", sorted(docgen.PAGES))
def test_a_stale_page_is_caught(rel, tmp_path, monkeypatch):
    monkeypatch.setattr(docgen, "DOCS", tmp_path)
    for page in docgen.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text((REPO / "docs" / page).read_text())
    assert docgen.stale() == []
    (tmp_path / rel).write_text((REPO / "docs" / rel).read_text().replace("ckptd", "ckptdd", 1))
    assert docgen.stale() == [f"docs/{rel}"]


def test_every_config_key_is_in_the_reference():
    page = (REPO / "docs" / "reference" / "configuration.md").read_text()
    for model in (config.Daemon, config.Root, config.Retention, config.RunRule, config.Pattern):
        for name, field in model.model_fields.items():
            assert (field.description or "").strip(), f"{model.__name__}.{name} has no description"
            assert f"### `{name}`" in page, name


def test_a_key_without_a_description_fails_the_generator(monkeypatch):
    """A key added without a description (what the reference is made of) stops docgen."""
    Undocumented = create_model(  # noqa: N806
        "Retention", __base__=config.Retention, __doc__=config.Retention.__doc__,
        keep_newer=(int, Field(0, ge=0)),
    )
    monkeypatch.setattr(config, "Retention", Undocumented)
    with pytest.raises(docgen.UndocumentedError, match=r"Retention\.keep_newer has no description"):
        docgen.configuration_page()


def test_every_command_and_option_is_in_the_cli_reference():
    from ckptd.cli import build_parser

    page = (REPO / "docs" / "reference" / "cli.md").read_text()
    for name, sub in docgen._subcommands(build_parser()).items():
        assert f"## `ckptd {name}`" in page
        for action in sub._actions:
            for flag in action.option_strings if action.dest != "help" else ():
                assert f"`{flag}`" in page, (name, flag)


def test_docgen_check_runs_from_a_checkout():
    proc = subprocess.run([sys.executable, "-m", "tools.docgen", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"})
    assert (proc.returncode, proc.stderr) == (0, "")
