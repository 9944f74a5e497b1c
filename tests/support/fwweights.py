"""Real Trainer and accelerate saves in each form their weights take, for the copy-in tests.

``python -m tests.support.fwweights OUT`` writes, with the frameworks' own saving code, one process each:

- ``trainer-safetensors/``: the Trainer's default (``model.safetensors``), checkpoint-2 and -4;
- ``trainer-sharded/``: the same with save_pretrained's ``max_shard_size`` lowered so that the
  weights are ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` (what a
  model over 50 GB gets; the Trainer passes no max_shard_size, so its default is lowered);
- ``trainer-save-only-model/``: ``save_only_model=True`` (weights, no optimizer, scheduler, rng);
- ``accelerate-safetensors/`` and ``accelerate-bin/``: ``save_state()`` into step_10, step_20,
  with ``safe_serialization`` True (``model.safetensors``) and False (``pytorch_model.bin``).

Prints one JSON line: {run: [checkpoint directories, oldest first]}. Imports fwgen's model setups
(fwgen imports no framework at import time).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import child_pythonpath, fwgen, refuse_in_light_test

REQUIRES = ("torch", "transformers", "accelerate", "safetensors")


def _trainer(out: Path, run: str, **overrides) -> list[str]:
    trainer = fwgen._trainer_parts(out / run, 4, eval_strategy="no", load_best_model_at_end=False,
                                   metric_for_best_model=None, ddp_backend=None, **overrides)
    trainer.train()
    return [f"{run}/checkpoint-2", f"{run}/checkpoint-4"]


def _accelerate(out: Path, run: str, safe: bool) -> list[str]:
    parts = fwgen._acc_setup()
    dirs = []
    for step in (10, 20):
        fwgen._acc_train(*parts, 2)
        parts[0].save_state(str(out / run / f"step_{step}"), safe_serialization=safe)
        dirs.append(f"{run}/step_{step}")
    return dirs


def main(out: Path) -> int:
    from transformers import modeling_utils

    out.mkdir(parents=True, exist_ok=True)
    runs = {
        "trainer-safetensors": _trainer(out, "trainer-safetensors"),
        "trainer-save-only-model": _trainer(out, "trainer-save-only-model", save_only_model=True),
    }
    original = modeling_utils.PreTrainedModel.save_pretrained
    modeling_utils.PreTrainedModel.save_pretrained = functools.partialmethod(original, max_shard_size="8KB")
    try:
        runs["trainer-sharded"] = _trainer(out, "trainer-sharded")
    finally:
        modeling_utils.PreTrainedModel.save_pretrained = original
    runs["accelerate-safetensors"] = _accelerate(out, "accelerate-safetensors", True)
    runs["accelerate-bin"] = _accelerate(out, "accelerate-bin", False)
    print(json.dumps(runs))
    return 0


def generate(out: Path, timeout: float = 600) -> dict[str, list[str]]:
    """Run this script in a fresh process (CPU only, offline); its {run: checkpoints}."""
    env = {**os.environ, **fwgen._CHILD_ENV, "PYTHONPATH": child_pythonpath()}
    proc = subprocess.run([sys.executable, "-m", "tests.support.fwweights", str(out)], capture_output=True, text=True, env=env,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"fwweights exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    refuse_in_light_test("a framework's own save (tests/support/fwweights.py)")
    sys.exit(main(Path(sys.argv[1])))
