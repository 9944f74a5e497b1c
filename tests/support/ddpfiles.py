"""A hand-made DDP-style checkpoint (the evidence, tracker and verdict tests)."""

from __future__ import annotations

import json
from pathlib import Path

from ckptd.cli.demo_volume import age, write_zip


def ddp_checkpoint(run: Path, step: int, ranks: int, mtime: float) -> Path:
    """A Trainer DDP checkpoint (no DeepSpeed): weights, optimizer, one rng_state per rank. Made by
    hand: the real Trainer's volumes are in test_frameworks.py; this varies the rank count."""
    ck = run / f"checkpoint-{step}"
    ck.mkdir(parents=True)
    write_zip(ck / "optimizer.pt", 64)
    write_zip(ck / "scheduler.pt", 16)  # the Trainer writes it with optimizer.pt (_save_optimizer_and_scheduler)
    write_zip(ck / "pytorch_model.bin", 64)  # WEIGHTS_NAME, as transformers 4 saved it
    for r in range(ranks):
        write_zip(ck / f"rng_state_{r}.pth", 16)
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    age(ck, mtime)
    return ck
