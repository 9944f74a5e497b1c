"""The engine names no framework: what ckptd knows about one lives in ckptd/frameworks/<name>.py.

A layout comparison outside frameworks/ (`layout == layouts.HF`, `c.layout in (...)`, a layout name
as a string) is a framework's rule in the engine, where the next framework's author will not look.
Recognition too is the frameworks' (`recognise_name`, `recognise_contents`): layouts.py only asks
them in registry order. Every question about a layout goes to `frameworks.get(layout)`.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from ckptd import frameworks
from ckptd.discover import layouts
from ckptd.frameworks.base import Framework

SRC = Path(frameworks.__file__).resolve().parents[2]  # the checkout
NAMES = ("HF", "DEEPSPEED", "MEGATRON", "DCP", "ORBAX", "TORCHTITAN", "LIGHTNING", "NEMO", "ACCELERATE", "PATTERN",
         "KERAS")
LAYOUT_NAMES = sorted(f.layout for f in frameworks.REGISTRY)
STRINGS = "|".join(LAYOUT_NAMES)
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
        if rel.startswith(("frameworks/", "integrations/")):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(p.search(code) for p in COMPARISONS):
                found.append(f"{rel}:{n}: {line.strip()}")
    return found


def test_no_layout_is_compared_outside_the_framework_modules():
    assert (SRC / "ckptd" / "judge" / "evidence.py").is_file()
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
    assert not any(hasattr(layouts, n) for n in NAMES)  # a new framework names its own layout, in its module
    assert len(set(LAYOUT_NAMES)) == len(frameworks.REGISTRY)
    for f in frameworks.REGISTRY:
        assert frameworks.get(f.layout) is f
        assert type(f).__module__ == f"ckptd.frameworks.{f.layout}"  # one module per framework, named for it
        assert f.layout == __import__(type(f).__module__, fromlist=["LAYOUT"]).LAYOUT
    assert frameworks.get("no such layout") is frameworks.USER_PATTERN  # nothing but quiet, and said so


def test_no_plugin_can_register_a_framework():
    """No entry points: code from outside that could say "complete" could make ckptd delete."""
    project = tomllib.loads((SRC / "pyproject.toml").read_text())["project"]
    assert set(project.get("entry-points", {})) == set()
    assert "importlib.metadata" not in (SRC / "ckptd" / "frameworks" / "__init__.py").read_text()


# --- no framework's names or files in the engine -------------------------------------------------

# A name part of the files and directories one framework's saves have: in the engine, it is that
# framework's knowledge, to be asked of it through the protocol (base.Framework).
FILE_PATTERN = re.compile(
    r"global_step|zero_pp_rank|mp_rank_|model_states|optim_states|trainer_state|rng_state|random_states"
    r"|\.distcp|lightning_logs|version_(?:\d|\\d)|iter_|latest_checkpointed|orbax|\.ckpt(?![a-z])|\.nemo|-unfinished"
    r"|safetensors|checkpoint-|_CHECKPOINT_METADATA|commit_success|metadata\.json|common\.pt|optimizer\.pt"
    r"|\.keras|\.weights\.h5|pytorch_model|adapter_model|meta\.pt|tp_rank|fsdp_shard"
)
# A generic module asking one framework's module by name rather than the registry.
# One framework's own module (the registry's functions, `ckptd.frameworks.get` and the like, and
# `base` are what the engine is meant to use).
_FW_MODULES = sorted(p.stem for p in (SRC / "ckptd" / "frameworks").glob("*.py")
                     if p.stem not in ("__init__", "base", "dsmeta", "formats"))
# (dsmeta: DeepSpeed's metadata, read safely; the verdict cache keeps its WorldSizes and
# consolidation reads it: a reader shared by design, as `base` is. formats: whether a zip,
# safetensors or tar file is whole, which the engine's integrity check and the frameworks both ask.)
FRAMEWORK_IMPORT = re.compile(rf"^ckptd\.frameworks\.({'|'.join(_FW_MODULES)})$")

# Generic modules (or single literals in them) that may name a framework, each with why. An entry
# that no longer matches anything fails the test: remove it.
ALLOWED: dict[str, str] = {
    "cli/demo_volume.py": "writes demo checkpoints in each framework's own layout (`ckptd demo`): its files by design",
    "cli/demo_live.py": "a simulated DeepSpeed job writing its files (`ckptd demo --live`): its files by design",
    "cli/common.py:deepspeed": "a Python package `doctor` checks slimming can import, not a layout",
    "cli/common.py:safetensors": "a Python package `doctor` checks slimming can import",
    "removal/zero_to_fp32.py:global_step<N>": "argparse help of the zero_to_fp32 consolidation tool",
    "removal/zero_to_fp32.py:model_states": "argparse help (metavar) of the zero_to_fp32 consolidation tool",
    "model.py:trainer_state": "a metric's source as `plan` prints it (user-facing text)",
    "config/models.py:global_step*/*optim_states.pt": "the default of the user's slim_files setting (config reference)",
    "config/models.py:optimizer.pt": "the default of the user's slim_files setting (config reference)",
    "judge/slim.py:model.safetensors.index.json": "ckptd's own consolidated fp32/ weights: it writes HF's sharded format",
    "judge/slim.py:.safetensors": "ckptd's own consolidated shard names (shard_name)",
    "judge/verdicts.py:trainer_state.json": "the key evidence.py stores the trainer-state verdict under: being moved",
}


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def framework_names(root: Path, allowed: dict[str, str]) -> tuple[list[str], set[str]]:
    """Each string literal in a generic module (every .py under `root` outside frameworks/ and
    integrations/) that is a layout's name or holds a framework's file pattern, and each import of
    one framework's module; and the `allowed` entries that matched. Prose (a literal with a space:
    help, messages) and docstrings may name what they like."""
    found, used = [], set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("frameworks/", "integrations/")):
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                s = node.value
                if s in LAYOUT_NAMES or (not re.search(r"\s", s) and FILE_PATTERN.search(s)):
                    what = s
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "ckptd.frameworks" else []
                what = next((m for m in [node.module, *names] if FRAMEWORK_IMPORT.match(m)), None)
            elif isinstance(node, ast.Import):
                what = next((a.name for a in node.names if FRAMEWORK_IMPORT.match(a.name)), None)
            if what is None:
                continue
            key = next((k for k in (rel, f"{rel}:{what}") if k in allowed), None)
            if key is not None:
                used.add(key)
            else:
                found.append(f"{rel}:{node.lineno}: {what!r}")
    return sorted(found), used


def test_no_generic_module_names_a_framework_or_its_files():
    """What a framework's saves are called, hold and write is its module's, asked through the
    protocol: not a literal in the engine. Each exception says why it stays."""
    found, used = framework_names(SRC / "ckptd", ALLOWED)
    assert found == []
    assert set(ALLOWED) - used == set(), "allowed, and no longer needed: remove"


def test_the_check_finds_a_framework_named_in_the_engine(tmp_path):
    pkg = tmp_path / "ckptd"
    (pkg / "frameworks").mkdir(parents=True)
    (pkg / "frameworks" / "hf.py").write_text('TRAINER_STATE = "trainer_state.json"\n')  # its own home: fine
    (pkg / "engine.py").write_text(
        '"""A docstring may say trainer_state.json."""\n'
        'if kind == "orbax": pass\n'
        'TAG = re.compile(r"global_step(\\d+)")\n'
        'path = f"{run}/{tag}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt"\n'
        'from ckptd.frameworks.megatron import TRACKER\n'
        'from ckptd.frameworks import nemo\n'
        'raise UsageError(f"{name} is not a .ckpt file Lightning wrote")  # prose: fine\n'
        'from ckptd.frameworks.base import Framework  # the protocol: fine\n'
        'x = ".ckptd-keep"  # ckptd\'s own: fine\n'
        'MARKER = "x.nemo"\n'
    )
    found, used = framework_names(pkg, {"engine.py:x.nemo": "allowed here"})
    assert sorted({int(line.split(":")[1]) for line in found}) == [2, 3, 4, 5, 6]
    assert used == {"engine.py:x.nemo"}


def test_recognition_asks_the_frameworks_in_registry_order():
    """layouts.py holds no framework's rule: it asks each framework, in registry order, and a user
    pattern comes after the frameworks whose names are their own (`names_first`)."""
    order = {f: i for i, f in enumerate(frameworks.REGISTRY)}
    for group in (frameworks.NAMES_FIRST, frameworks.NAMES_AFTER, frameworks.BY_CONTENTS):
        assert [order[f] for f in group] == sorted(order[f] for f in group)
    patterns = [layouts.compile_pattern("checkpoint-{step}"), layouts.compile_pattern("{step}.keras")]
    assert layouts.recognise_by_name("checkpoint-5", True, patterns).pattern is None  # the Trainer's own name
    assert layouts.recognise_by_name("5.keras", False, patterns).pattern == 1  # the user's pattern, then Keras
    assert layouts.recognise_by_name("epoch=5.keras", False, patterns).layout == "keras"
