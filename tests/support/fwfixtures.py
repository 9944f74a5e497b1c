"""Session volumes written by the real frameworks' own saving code (fwgen.py; FWGEN_NOTES.md).

Each fixture returns fwgen's description of its volume (``out_dir``; ``runs``; ``checkpoints``: one
record per checkpoint with ``path``, ``abs_path``, ``run``, ``step``, ``killed`` and ``truth``, the
framework's own verdict).  A volume is generated once per session and shared: copy it
(:func:`copy_volume`) before changing anything in it.  A fixture skips, with the reason, when its
framework is not installed; that is decided without importing the framework (jax and transformers
take seconds). Each is kept across runs (tests/support/volcache.py: keyed by the packages' versions
and the generators' source; CKPTD_TESTS_NO_CACHE=1 turns it off); a session gets its own copy.

The torch frameworks (DCP, accelerate, the Trainer, Lightning) come from one coordinator process,
so torch and what they share are imported once; the first fixture asked for generates all four.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.cli.demo_volume import age
from tests.support import fwgen, volcache

TORCH_FRAMEWORKS = ("dcp", "accelerate", "trainer", "lightning")


def copy_volume(volume: dict[str, Any], dest: Path, *, age_seconds: float = 3600) -> Path:
    """A private copy of ``volume``'s root at ``dest``, every mtime ``age_seconds`` in the past.

    Ageing is done with os.utime, so a quiet period is over without waiting."""
    shutil.copytree(volume["out_dir"], dest, symlinks=True)
    age(dest, time.time() - age_seconds)
    return dest


def _skip_if_missing(framework: str) -> None:
    if (why := fwgen.missing(framework)) is not None:
        pytest.skip(why)


@pytest.fixture(scope="session")
def fw_torch_volumes(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """{framework: volume} for the installed torch frameworks, from one coordinator."""
    names = [n for n in TORCH_FRAMEWORKS if fwgen.missing(n) is None]
    if not names:
        return {}
    return volcache.generated("fw-torch", names, ("fwgen.py",), tmp_path_factory.mktemp("fw-torch"),
                              lambda out: fwgen.generate(names, out, timeout=600))


@pytest.fixture(scope="session")
def weights_volume(tmp_path_factory) -> dict[str, Any]:
    """fwweights' Trainer and accelerate runs, each form of weights they write: {out_dir, runs}."""
    from tests.support import fwweights

    for framework in ("trainer", "accelerate"):
        _skip_if_missing(framework)
    out = tmp_path_factory.mktemp("fw-weights")
    return volcache.generated("fw-weights", [], ("fwweights.py", "fwgen.py"), out,
                              lambda out: {"out_dir": out, "runs": fwweights.generate(out)})


@pytest.fixture(scope="session")
def dcp_one(tmp_path_factory) -> dict[str, Any]:
    """One real DCP save (`.metadata`, `__0_0.distcp`) by torch's own writer in one process
    (tests/support/fwdcp_one.py): {out_dir}. `fwdcp_one.put_dcp` copies it into a hand-made
    look-alike of a framework that cannot save here (NeMo's weights/, megatron-core's torch_dist)."""
    _skip_if_missing("dcp")

    def make(out: Path) -> dict[str, Any]:
        proc = fwgen.run_module("fwdcp_one", str(out))
        assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
        return {"out_dir": out}

    return volcache.generated("fw-dcp-one", [], ("fwdcp_one.py",), tmp_path_factory.mktemp("fw-dcp-one"), make)


@pytest.fixture(scope="session")
def orbax_volume(tmp_path_factory) -> dict[str, Any]:
    """Orbax CheckpointManager runs; step-3 saves killed at five points of the commit."""
    _skip_if_missing("orbax")
    return volcache.generated("fw-orbax", [], ("fwgen.py",), tmp_path_factory.mktemp("fw-orbax"),
                              fwgen.generate_orbax)


@pytest.fixture(scope="session")
def dcp_volume(fw_torch_volumes) -> dict[str, Any]:
    """torch.distributed.checkpoint, 2 ranks, torchtitan's checkpoint/step-N; two saves killed."""
    _skip_if_missing("dcp")
    return fw_torch_volumes["dcp"]


@pytest.fixture(scope="session")
def accelerate_volume(fw_torch_volumes) -> dict[str, Any]:
    """accelerate save_state, 2 processes: checkpoints/checkpoint_N, step_N, epoch_N; two saves killed."""
    _skip_if_missing("accelerate")
    return fw_torch_volumes["accelerate"]


@pytest.fixture(scope="session")
def trainer_volume(fw_torch_volumes) -> dict[str, Any]:
    """The HF Trainer, 2-process DDP: checkpoint-2..-8 whole, checkpoint-10 killed in each of two runs."""
    _skip_if_missing("trainer")
    return fw_torch_volumes["trainer"]


@pytest.fixture(scope="session")
def lightning_volume(fw_torch_volumes) -> dict[str, Any]:
    """Lightning ModelCheckpoint under team/run/lightning_logs/version_0/checkpoints; three saves killed."""
    _skip_if_missing("lightning")
    return fw_torch_volumes["lightning"]
