"""The Python API a training script uses: every name the docs promise imports as a user writes
it, `import ckptd` stays light, and `ckptd.__all__` and docs/reference/python.md list the same
names. Each import runs in a fresh interpreter: in this one, other tests have imported it all."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys

import pytest

from tests.support.common import REPO

PAGE = REPO / "docs" / "reference" / "python.md"
HEAVY = ("torch", "numpy", "pydantic", "transformers", "accelerate", "deepspeed", "lightning", "watchdog")

# each name the docs promise: the module it lives in, and its name there (None: the module itself)
PROMISED = {
    "latest": ("ckptd.resume", "latest"),
    "NothingToResumeError": ("ckptd.resume", "NothingToResumeError"),
    "CkptdError": ("ckptd.errors", "CkptdError"),
    "attest": ("ckptd.attest", None),
    "integrations": ("ckptd.integrations", None),
}
INTEGRATIONS = {"hf": "AttestCallback", "accelerate": "install", "deepspeed": "wrap",
                "lightning": "AttestedModelCheckpoint"}


def _python(code: str) -> dict:
    """Run `code` in a fresh interpreter (this checkout's src/ first: tests/conftest.py) and
    return what it printed as JSON."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _is(module: str, attr: str | None) -> str:
    """Code that prints whether `got` is `attr` of `module` (or the module), and which heavy
    modules the import brought."""
    want = f"importlib.import_module({module!r})" + (f".{attr}" if attr else "")
    return (f"import importlib, json, sys\nwant = {want}\n"
            f"print(json.dumps({{'same': got is want, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))")


def test_import_ckptd_is_light():
    """`import ckptd` loads no engine, no framework and no torch: a training script pays nothing
    for it until it calls something."""
    out = _python("import json, sys, ckptd\n"
                  f"print(json.dumps([m for m in sys.modules if m.split('.')[0] in {HEAVY!r}"
                  " or m in ('ckptd.resume', 'ckptd.decide.planner', 'ckptd.config', 'ckptd.attest')]))")
    assert out == []


@pytest.mark.parametrize("name", sorted(PROMISED))
def test_from_ckptd_import_name(name):
    out = _python(f"from ckptd import {name} as got\n" + _is(*PROMISED[name]))
    assert out["same"], name
    assert [m for m in out["heavy"] if m != "pydantic"] == [], out  # the engine (pydantic) only for latest
    if name not in ("latest", "NothingToResumeError"):
        assert out["heavy"] == [], out


@pytest.mark.parametrize("name", sorted(PROMISED))
def test_import_ckptd_then_the_attribute(name):
    out = _python(f"import ckptd\ngot = ckptd.{name}\n" + _is(*PROMISED[name]))
    assert out["same"], name


@pytest.mark.parametrize("module", sorted(INTEGRATIONS))
def test_each_integration_as_the_docs_write_it(module):
    """The frameworks' pages write `import ckptd.integrations.hf`; plain `import ckptd` reaches it
    too. Neither imports the framework: it is imported when the hook runs."""
    name = INTEGRATIONS[module]
    for how in (f"import ckptd.integrations.{module}\n", "import ckptd\n"):
        out = _python(how + f"got = ckptd.integrations.{module}.{name}\n"
                      + _is(f"ckptd.integrations.{module}", name))
        assert out == {"same": True, "heavy": []}, (how, out)


def test_an_unknown_name_is_an_attribute_error():
    import ckptd

    with pytest.raises(AttributeError, match=r"module 'ckptd' has no attribute 'lastest'"):
        ckptd.lastest  # noqa: B018
    with pytest.raises(AttributeError, match=r"'ckptd\.integrations' has no attribute 'keras'"):
        ckptd.integrations.keras  # noqa: B018
    with pytest.raises(ImportError):
        exec("from ckptd import lastest", {})


def test_all_is_what_is_promised_and_dir_shows_it():
    import ckptd

    assert sorted(ckptd.__all__) == sorted(["__version__", *PROMISED])
    assert set(ckptd.__all__) <= set(dir(ckptd))
    assert sorted(importlib.import_module("ckptd.integrations").__all__) == sorted(INTEGRATIONS)
    for module, name in INTEGRATIONS.items():
        assert importlib.import_module(f"ckptd.integrations.{module}").__all__ == [name]


def _headings(level: str) -> list[str]:
    return re.findall(rf"^{level} `([\w.]+)`$", PAGE.read_text(), re.M)


def test_the_reference_page_and_all_agree():
    """Each `##` heading of docs/reference/python.md is a name in `ckptd.__all__` and each `###`
    one a name in its module's `__all__`, both ways; the integrations' sections name their one
    function."""
    import ckptd

    assert sorted(_headings("##")) == sorted(f"ckptd.{n}" for n in ckptd.__all__)
    modules = {"ckptd.attest": ckptd.attest, "ckptd.integrations": ckptd.integrations}
    want = sorted(f"{path}.{n}" for path, module in modules.items() for n in module.__all__)
    assert sorted(_headings("###")) == want
    text = PAGE.read_text()
    for module, name in INTEGRATIONS.items():
        section = text.split(f"### `ckptd.integrations.{module}`")[1].split("\n#")[0]
        assert f"ckptd.integrations.{module}.{name}(" in section, module


def test_a_name_missing_from_the_page_is_caught(monkeypatch):
    """The agreement test can fail: a name added to `__all__` without a section on the page."""
    import ckptd

    monkeypatch.setattr(ckptd, "__all__", [*ckptd.__all__, "find_latest"])
    with pytest.raises(AssertionError):
        test_the_reference_page_and_all_agree()
