"""The engine names no framework: what ckptd knows about one lives in src/ckptd/frameworks/<name>.py.

A layout comparison outside frameworks/ (`layout == layouts.HF`, `c.layout in (...)`, a layout name
as a string) is a framework's rule in the engine, where the next framework's author will not look.
Recognition (layouts.py) names the layout it found (`Candidate(..., ORBAX, ...)`), which is not a
comparison; every question about a layout goes to `frameworks.get(layout)`.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from ckptd import frameworks, layouts
from ckptd.frameworks.base import Framework

SRC = Path(frameworks.__file__).resolve().parents[2]  # src/
NAMES = ("HF", "DEEPSPEED", "MEGATRON", "DCP", "ORBAX", "TORCHTITAN", "LIGHTNING", "NEMO", "ACCELERATE", "PATTERN",
         "KERAS")
STRINGS = "|".join(getattr(layouts, n) for n in NAMES if hasattr(layouts, n)) + "|keras"
NAME = rf"(?:layouts\.)?(?:{'|'.join(NAMES)})\b"
COMPARISONS = [
    re.compile(r"\blayout\s*(?:==|!=)"),
    re.compile(r"^(?!\s*for\b).*\blayout\s+(?:not\s+)?in\b"),  # a membership test, not a for loop
    re.compile(rf"(?:==|!=)\s*{NAME}"),
    re.compile(rf"\b{NAME}\s*(?:==|!=)"),
    re.compile(rf"\bin\s*[(\[{{]\s*{NAME}"),
    re.compile(rf"(?:==|!=|\bin\s*[(\[{{])\s*[\"'](?:{STRINGS})[\"']"),
    re.compile(rf"\blayouts\.(?:{'|'.join(NAMES)})\b"),  # the engine does not name a framework at all
]


def offending_lines(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("frameworks/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if rel == "layouts.py" and not any(p.search(code) for p in COMPARISONS[:6]):
                continue  # recognition names the layouts it finds: a name there is not a comparison
            if any(p.search(code) for p in COMPARISONS):
                found.append(f"{rel}:{n}: {line.strip()}")
    return found


def test_no_layout_is_compared_outside_the_framework_modules():
    assert (SRC / "ckptd" / "evidence.py").is_file()
    assert offending_lines(SRC / "ckptd") == []


def test_the_check_finds_a_comparison(tmp_path):
    """The grep can fail: each form a framework's rule took in the engine is found."""
    pkg = tmp_path / "ckptd"
    (pkg / "frameworks").mkdir(parents=True)
    (pkg / "frameworks" / "hf.py").write_text("if layout == layouts.HF: pass\n")  # its own home: fine
    (pkg / "engine.py").write_text(
        "if c.layout == layouts.HF: pass\n"
        "if layout in (layouts.DCP, layouts.TORCHTITAN): pass\n"
        "if cand.layout != DEEPSPEED: pass\n"
        "if kind == 'orbax': pass\n"
        "x = layouts.NEMO  # a name: comparisons follow\n"
        "ok = frameworks.get(layout).named_alone\n"
    )
    assert [line.split(":")[1] for line in offending_lines(pkg)] == ["1", "2", "3", "4", "5"]


def test_every_layout_has_its_framework_in_a_closed_ordered_registry():
    assert isinstance(frameworks.REGISTRY, tuple)
    assert all(isinstance(f, Framework) for f in frameworks.REGISTRY)
    layouts_named = {getattr(layouts, n) for n in NAMES if hasattr(layouts, n)}
    assert {f.layout for f in frameworks.REGISTRY} >= layouts_named  # a new framework names its own layout
    assert len({f.layout for f in frameworks.REGISTRY}) == len(frameworks.REGISTRY)
    for layout in layouts_named:
        assert frameworks.get(layout).layout == layout
    assert frameworks.get("no such layout") is frameworks.get(layouts.PATTERN)  # nothing but quiet, and said so


def test_no_plugin_can_register_a_framework():
    """No entry points: code from outside that could say "complete" could make ckptd delete."""
    project = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["project"]
    assert set(project.get("entry-points", {})) == set()
    assert "importlib.metadata" not in (SRC / "ckptd" / "frameworks" / "__init__.py").read_text()
