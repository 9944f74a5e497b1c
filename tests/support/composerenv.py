"""MosaicML Composer for tests/completeness/test_composer.py, beside the test extra's torch.

Composer 0.32 pins `torch<2.7.1` (and torchvision, `numpy<2.3`, `torchmetrics<1.7.5`), so pip's
resolver cannot install it beside the torch 2.13 of `pip install -e '.[deepspeed,test]'`; its
checkpoint code runs on torch 2.13 all the same. So the tests install it themselves, apart: the
distributions in PINS (Composer and what its import needs that the test extra does not bring), exact
versions, `--no-deps`, wheels only, into a folder with `pip install --target`. The Composer children
run on the tests' own interpreter with that folder on PYTHONPATH (ahead of site-packages: its
`importlib-metadata<9` and `coolname<3` win over newer ones there), so they see the test venv's
torch, numpy and torchmetrics, and Composer.

The folder is built once and kept: `composer-<hash>` in the tests' cache (volcache.cache_root(),
even with CKPTD_TESTS_NO_CACHE: it is an install, not a generated volume), the hash over PINS, the
Python version and the platform. It appears whole or not at all (built beside it, renamed into
place); one build at a time across processes (a flock). Delete it to rebuild.

Where the package index cannot be reached (pip's "connection broken by" before "No matching
distribution"), the tests skip and say so; any other failure to install or import is a failure.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support import REPO, volcache

# Composer 0.32.1 and what its import and its Trainer on the CPU need that the test extra does not
# install, within mosaicml's own bounds (its METADATA: mosaicml-cli<0.8, coolname<3, tabulate==0.9.0,
# importlib-metadata<9, pillow<12); then what mcli's import needs (backoff ... validators), and the
# direct dependencies of these that the test extra brings only by way of others (zipp, graphql-core).
# mcli 0.7.5 declares gql<4, questionary<2.1 and rich<14: only its import runs here (no remote call),
# and the newer ones (rich from the test venv) import. Declared but never imported on this path:
# torch_optimizer, arrow, termcolor, argcomplete. The torch stack (torch, numpy, torchmetrics, ...) is
# the test venv's on purpose: those are the versions ckptd is tested with.
PINS = (
    "mosaicml==0.32.1",
    "mosaicml-cli==0.7.5",
    "coolname==2.2.0",
    "tabulate==0.9.0",
    "importlib-metadata==8.9.0",
    "zipp==4.1.2",
    "pillow==11.3.0",
    "backoff==2.2.1",
    "gql==4.4.0",
    "graphql-core==3.3.2",
    "tenacity==9.2.1",
    "websockets==17.4",
    "ruamel.yaml==0.19.1",
    "questionary==2.1.1",
    "prompt_toolkit==3.0.53",
    "wcwidth==0.9.5",
    "validators==0.36.0",
)
# pip's word for a request that never reached the index (refused, no DNS, a dead proxy, a timeout)
UNREACHABLE = "connection broken by"


def key() -> str:
    what = {"pins": PINS, "python": sys.implementation.cache_tag, "platform": sysconfig.get_platform()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def env() -> dict[str, str]:
    """The environment of a Composer child (`python -m tests.support.fwcomposer ...` on
    sys.executable): the checkout, then Composer's folder (built now if it is not there yet)."""
    folder = install()
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": _pythonpath(folder)}


def _pythonpath(folder: Path) -> str:
    """This checkout (test this tree's ckptd), Composer's folder, then what was there."""
    return os.pathsep.join(filter(None, [str(REPO), str(folder), os.environ.get("PYTHONPATH")]))


def install() -> Path:
    """The folder Composer is installed in: the cached one, or built now. Skips where the package
    index cannot be reached; fails on anything else that stops it."""
    root = volcache.cache_root()
    folder = root / f"composer-{key()}"
    if folder.is_dir():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{folder.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not folder.is_dir():  # another process may have built it while this one waited
            _build(folder)
    return folder


def _build(folder: Path) -> None:
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:", "--no-input",
             "--disable-pip-version-check", "--retries", "2", "--timeout", "60", "--target", str(tmp), *PINS],
            capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
        out = proc.stdout + proc.stderr
        if proc.returncode != 0:
            broken = [line for line in out.splitlines() if UNREACHABLE in line]
            if broken and "No matching distribution found" in out:
                pytest.skip(f"Composer cannot be installed: the package index cannot be reached ({broken[-1][:300]})")
            pytest.fail(f"installing Composer ({' '.join(PINS)}) failed (exit {proc.returncode}):\n{out[-3000:]}")
        # Its import, as the children do it (fwcomposer's torchvision stand-in), before the folder is kept.
        check = subprocess.run(
            [sys.executable, "-c", "from tests.support import fwcomposer; fwcomposer._parts()"],
            env={**os.environ, "PYTHONPATH": _pythonpath(tmp)},
            capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        if check.returncode != 0:
            pytest.fail(f"Composer, installed from {' '.join(PINS)}, does not import:\n{check.stderr[-3000:]}")
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

