"""The README's install commands: CI runs them verbatim, and they fetch the CPU build of torch.

PyPI's `torch==2.13.0` is the CUDA build (with ~20 nvidia-*/cuda-*/triton packages);
the CPU build is `2.13.0+cpu` on PyTorch's CPU index. The README's first step takes
torch from that index alone (`--index-url`, `--no-deps`), so an unreachable index is
a failure, never a silent fall-back to the CUDA build.

The stock-machine case is replayed against a stand-in for PyTorch's index: a simple
index served on loopback holding a tiny wheel named like the CPU build (the real one
is 190 MB and PyTorch's index cannot be reached here), with pip's own configuration
switched off (PIP_CONFIG_FILE=/dev/null) so this machine's wheel directory cannot help.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from tests.support.common import REPO
from tests.support.readme import ci_lines, readme_test_command

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_ci_runs_the_readme_test_command_verbatim():
    command = readme_test_command()
    assert "\n" not in command
    assert command in ci_lines()


def test_the_readme_takes_the_cpu_torch_from_pytorchs_index_alone():
    first, second, tests = readme_test_command().split(" && ")
    args = shlex.split(first)
    assert args[:2] == ["pip", "install"]
    assert args[args.index("--index-url") + 1] == CPU_INDEX  # not --extra-index-url: no CUDA fall-back
    assert "--no-deps" in args and "--extra-index-url" not in args
    [pin] = [a for a in args if a.startswith("torch==")]
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"{pin}"' in pyproject  # the deepspeed extra's pin: the second step keeps what the first installed
    assert shlex.split(second)[:3] == ["pip", "install", "-q"] and "[deepspeed,test]" in second
    assert tests.startswith("python3 -m pytest")


def test_the_dockerfile_takes_the_same_torch_from_the_same_index():
    text = (REPO / "Dockerfile").read_text()
    assert f"ARG TORCH_INDEX_URL={CPU_INDEX}\n" in text
    [pin] = [a for a in shlex.split(readme_test_command().split(" && ")[0]) if a.startswith("torch==")]
    assert re.search(rf'--index-url "\$TORCH_INDEX_URL" (--no-deps )?{re.escape(pin)}', text)


# --- the first step against a stand-in for PyTorch's CPU index -------------------------


def fake_wheel(directory: Path, version: str) -> Path:
    """A wheel called torch, with one dependency, so that --no-deps shows."""
    name = f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    path = directory / name
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
                   "Requires-Dist: ckptd-test-not-a-package-on-any-index\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def cpu_index(tmp_path):
    """A PEP 503 simple index on loopback with torch 2.13.0+cpu; yields its URL."""
    wheel = fake_wheel(tmp_path, "2.13.0+cpu")
    page = tmp_path / "simple" / "torch"
    page.mkdir(parents=True)
    href = "../../" + wheel.name.replace("+", "%2B")
    page.joinpath("index.html").write_text(f'<html><body><a href="{href}">{wheel.name}</a></body></html>\n')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))

    class Quiet(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):  # pip closing early is not news
            pass

    server = Quiet(("127.0.0.1", 0), handler)
    server.RequestHandlerClass.log_message = lambda *a: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def stock_pip_env(tmp_path: Path) -> dict[str, str]:
    """pip with no configuration of this machine's: no wheel directory, no local indexes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_RETRIES="0", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_CACHE_DIR="1")
    return env


def first_step(url: str, report: Path) -> list[str]:
    """The README's first step, with `url` for PyTorch's index, as a dry run that writes a report."""
    args = shlex.split(readme_test_command().split(" && ")[0])
    args[args.index("--index-url") + 1] = url
    return [sys.executable, "-m", *args, "--dry-run", "--ignore-installed", "--report", str(report)]


def test_the_first_step_picks_the_cpu_build_and_only_it(tmp_path, cpu_index):
    report = tmp_path / "report.json"
    proc = subprocess.run(first_step(cpu_index, report), env=stock_pip_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    installs = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
    assert installs == [("torch", "2.13.0+cpu")]  # and not its dependency: --no-deps


def test_the_first_step_fails_when_the_cpu_index_has_no_torch(tmp_path, cpu_index):
    """What an unreachable PyTorch index comes to: an error, not PyPI's CUDA build."""
    report = tmp_path / "report.json"
    proc = subprocess.run(first_step(cpu_index.replace("/simple", "/nothing-here"), report),
                          env=stock_pip_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "torch==2.13.0" in proc.stderr


# --- CI is a fresh machine -------------------------------------------------------------


def test_ci_installs_into_a_fresh_virtual_environment_before_the_readme_command():
    """A green CI on a machine that already has the packages hides a missing install step."""
    lines = ci_lines()
    command = lines.index(readme_test_command())
    venv = next(i for i, line in enumerate(lines) if re.search(r"python3 -m venv \S+", line))
    activate = next(i for i, line in enumerate(lines) if re.search(r'^\. "?\$venv"?/bin/activate', line))
    made_here = next(i for i, line in enumerate(lines) if re.search(r"^venv=.*mktemp -d", line))
    assert made_here < venv < activate < command


def test_every_test_dependency_has_an_upper_bound():
    """The test extra is installed afresh each run: an open range breaks it the day a new major lands."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    unbounded = [req for req in extras["test"] if not re.search(r"(<|==|~=)", req)]
    assert not unbounded, f"test dependencies without an upper bound: {unbounded}"
