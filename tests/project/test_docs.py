"""The docs site: generated reference pages are current, every config key and option is
described, and what other tests read from the docs is where they look for it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field, create_model

from tests.support.common import REPO

sys.path.insert(0, str(REPO))  # tools/ is not installed: it is run from a checkout

from ckptd import config
from tools import docgen


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
    Undocumented = create_model(
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
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert (proc.returncode, proc.stderr) == (0, "")


# --- the README and the site ---------------------------------------------------------

README = REPO / "README.md"


def test_the_readme_is_short():
    assert len(README.read_bytes()) <= 12 * 1024


def _toml_block(text: str) -> str:
    return text[text.index("```toml\n") + len("```toml\n"):].split("```")[0]


def test_the_readmes_config_is_valid_and_means_what_it_says(tmp_path):
    """The commonest case: HF Trainer + DeepSpeed, the last 2 and the best by eval_loss."""
    block = _toml_block(README.read_text())
    assert block == _toml_block((REPO / "docs" / "getting-started.md").read_text())
    path = tmp_path / "config.toml"
    path.write_text(block)
    root = config.load_config(path).roots[0]
    r = root.retention
    assert (r.keep_last, r.keep_best, r.metric, r.mode, r.keep_total) == (2, 1, "eval_loss", "min", None)
    assert root.world_size is None and r.keep_full_last is None and r.max_size is None and r.min_free is None


def test_the_readme_says_what_to_switch_off_in_the_trainer():
    text = README.read_text()
    for setting in ("save_total_limit=None", "save_top_k=-1", "keep_total = N"):
        assert setting in text


def _links(text: str) -> list[str]:
    import re

    return [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in m]


def test_the_readmes_links_lead_somewhere():
    links = _links(README.read_text())
    assert "docs/reference/configuration.md" in links and "docs/frameworks/index.md" in links
    for link in links:
        assert (REPO / link).exists(), link


def _nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_every_page_is_in_the_nav():
    """mkdocs only notes a page left out of the nav (omitted_files: info); a reader cannot find it."""
    import yaml

    nav = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    pages = sorted(str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md"))
    assert [p for p in pages if p not in nav] == []
    assert [p for p in nav if p not in pages] == []


def test_the_site_builds_strictly(tmp_path):
    """CI installs the docs extra after the tests and runs the same; here where mkdocs is installed."""
    import shutil

    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).parent / "mkdocs")
    if not Path(mkdocs).exists():
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]'); .ci/run builds the site itself")
    proc = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()


def test_ci_builds_the_site_after_the_readmes_test_command():
    from tests.support.readme import ci_lines, readme_test_command

    lines = ci_lines()
    test_at = lines.index(readme_test_command())
    [build_at] = [i for i, line in enumerate(lines) if "mkdocs build --strict" in line]
    assert build_at > test_at and "pip install -q -e '.[docs]'" in lines[build_at]
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"mkdocs>=1.6,<2"' in pyproject and '"mkdocs-material>=9,<10"' in pyproject


def test_the_recipes_delete_nothing_beyond_the_defaults(monkeypatch):
    """What the deployment pages install: the systemd recipe config.example.toml (at the defaults:
    test_config), the docker, compose and Kubernetes examples CKPTD_* variables that set no budget,
    no slimming and no rule keeping fewer than the defaults do."""
    import yaml

    from ckptd.config.effective import effective_config

    systemd = (REPO / "docs" / "deployment" / "systemd.md").read_text()
    installs = re.findall(r"install -m 644 (\S+) /etc/ckptd/\S+\.toml", systemd)
    assert installs and set(installs) == {"config.example.toml"}
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["ckptd"]["environment"]
    pod = [d for d in yaml.safe_load_all((REPO / "k8s" / "ckptd-sidecar.yaml").read_text()) if d["kind"] == "Pod"]
    [sidecar] = [c for c in pod[0]["spec"]["initContainers"] if c["name"] == "ckptd"]
    docker_run = (REPO / "docs" / "deployment" / "docker.md").read_text()
    docker_env = dict(re.findall(r"-e (CKPTD_\w+)=(\S+)", docker_run))
    assert docker_env and "CKPTD_WORLD_SIZE" not in docker_env
    defaults = config.Retention()
    for env in ({k: str(v) for k, v in compose.items()}, {e["name"]: e["value"] for e in sidecar["env"]}, docker_env):
        r = effective_config(None, env).roots[0].retention
        assert (r.max_size, r.min_free, r.keep_full_last, r.keep_total) == (None, None, None, None), env
        assert r.keep_last >= defaults.keep_last and r.keep_best >= defaults.keep_best, env


def test_troubleshooting_lists_every_exit_code():
    """Every exit code ckptd's --help names (and each sysexits constant it raises) has a row in
    docs/troubleshooting.md's table: 74 for a busy metrics port was missing."""
    from ckptd import errors
    from ckptd.cli.parser import EPILOG, EX_PIPE, EX_TEMPFAIL

    text = (REPO / "docs" / "troubleshooting.md").read_text()
    table = text[text.index("## Every exit code"):]
    rows = {int(m[1]) for m in re.finditer(r"^\| (\d+) \|", table, re.M)}
    named = {int(n) for n in re.findall(r"\b(\d+) [a-z]", EPILOG.split("config:")[0])}
    constants = {v for k, v in vars(errors).items() if k.startswith("EX_")} | {EX_PIPE, EX_TEMPFAIL}
    assert named | constants <= rows, sorted((named | constants) - rows)
    assert "metrics_listen" in table.split("| 74 |")[1].split("\n")[0]


# --- pages a user can skim -------------------------------------------------------------
# The user-facing pages (docs/ but its design notes, and README.md) hold no table cell over
# CELL_LIMIT characters and no paragraph over PARAGRAPH_LIMIT: past that a reader skimming for
# what to do stops reading. How the page is cut up (`_skim_units`):
# - fenced code blocks (``` or ~~~) are skipped, and so are headings;
# - a table row (a line starting with `|`) is split into cells at each `|` not escaped as `\|`;
# - a list item (`-`, `*`, `+` or `1.` at any indent) counts as a paragraph of its own, with
#   the lines that continue it (up to the next item, blank line, table row or heading);
# - a paragraph is the other lines between blank lines, joined with spaces;
# - length is what the reader sees of the markdown: a link `[text](target)` counts as its text.
CELL_LIMIT = 300
PARAGRAPH_LIMIT = 800
# Pages others were rewriting when these limits came in: each still breaks them, and is held
# to them once it is rewritten (the test below fails when an entry here is no longer needed).
SKIM_PENDING = {
}
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_FENCE = re.compile(r"^\s*(```+|~~~+)")


def _skim_pages() -> list[Path]:
    docs = sorted(p for p in (REPO / "docs").rglob("*.md") if p.relative_to(REPO / "docs").parts[0] != "design")
    return [*docs, README]


def _skim_units(text: str) -> list[tuple[str, int, int]]:
    """(kind, first line, length) of each cell, list item and paragraph of a markdown page."""
    units: list[tuple[str, int, list[str]]] = []
    fence, current = None, None
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence:
            fence = None if stripped.startswith(fence) else fence
            continue
        if (opening := _FENCE.match(line)) or not stripped or stripped.startswith(("|", "#")):
            current = None
            fence = opening[1] if opening else None
            if stripped.startswith("|"):
                units += [("cell", n, [cell]) for cell in re.split(r"(?<!\\)\|", stripped.strip("|"))]
            continue
        if _ITEM.match(line):
            current = ("list item", n, [_ITEM.sub("", line)])
            units.append(current)
        elif current is None:
            current = ("paragraph", n, [stripped])
            units.append(current)
        else:
            current[2].append(stripped)
    return [(kind, n, len(_LINK.sub(r"\1", " ".join(lines)).strip())) for kind, n, lines in units]


def _too_long(page: Path) -> list[str]:
    rel = page.relative_to(REPO).as_posix()
    return [f"{rel}:{n}: a {kind} of {length} characters (at most {CELL_LIMIT if kind == 'cell' else PARAGRAPH_LIMIT})"
            for kind, n, length in _skim_units(page.read_text())
            if length > (CELL_LIMIT if kind == "cell" else PARAGRAPH_LIMIT)]


def test_user_pages_have_no_long_cells_or_paragraphs():
    """Split a long cell into a shorter one and a section or list below the table; a long
    paragraph into a list, or shorter sentences in two paragraphs."""
    found = [line for page in _skim_pages() if page.relative_to(REPO).as_posix() not in SKIM_PENDING
             for line in _too_long(page)]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("rel", sorted(SKIM_PENDING))
def test_each_page_let_off_the_limits_still_needs_it(rel):
    assert _too_long(REPO / rel), f"{rel} keeps the limits now: remove it from SKIM_PENDING"


def test_the_skim_limits_measure_what_they_say(tmp_path):
    cell, para = "x" * (CELL_LIMIT + 1), " ".join(["word"] * 200)  # 999 characters
    page = tmp_path / "page.md"
    page.write_text(f"# T\n\n| a | b |\n|---|---|\n| ok | {cell} |\n\n```\n{para}\n```\n\n{para}\n"
                    f"\n- short\n- {para[:700]}\n  {para[:200]}\n- [{'y' * 10}]({'z' * 900})\n\n`a \\| b` {'w' * 290} |\n")
    assert [(kind, n) for kind, n, length in _skim_units(page.read_text())
            if length > (CELL_LIMIT if kind == "cell" else PARAGRAPH_LIMIT)] == [
        ("cell", 5), ("paragraph", 11), ("list item", 14)]


def test_troubleshooting_says_what_to_do_about_an_incomplete_checkpoint():
    """The section a user lands on for "incomplete" gives steps, and each command it names is
    one `ckptd --help` lists; the site's search ranks the page above the design notes
    (mkdocs-material's `search.boost` front matter: no design page is boosted as high)."""
    import yaml

    from ckptd.cli import build_parser

    text = (REPO / "docs" / "troubleshooting.md").read_text()
    assert "\n## A checkpoint stays incomplete\n" in text
    section = text[text.index("## A checkpoint stays incomplete\n"):].split("\n## ")[0]
    steps = re.findall(r"^\d+\. \*\*(.+?)\*\*", section, re.M)
    assert len(steps) >= 3, steps
    commands = set(docgen._subcommands(build_parser()))
    named = set(re.findall(r"`ckptd (\w[\w-]*)", section))
    assert {"verify", "plan"} <= named and named <= commands, named - commands
    assert re.search(r"^\| .+ \| .+ \| .+ \|$", section, re.M)  # what it says | what it means | what to do

    def boost(page: Path) -> float:
        text = page.read_text()
        front = yaml.safe_load(text.split("---\n")[1]) if text.startswith("---\n") else {}
        return float(((front or {}).get("search") or {}).get("boost", 1))

    design = [boost(p) for p in (REPO / "docs" / "design").rglob("*.md")]
    assert boost(REPO / "docs" / "troubleshooting.md") > max(design)
