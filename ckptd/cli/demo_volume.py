"""A small example volume, for trying ckptd without a training job: `ckptd demo DIR`.

Files are shaped like the real ones (names, zip containers, trainer_state.json)
but hold no weights. The same writers build the synthetic layouts in the tests.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from collections.abc import Iterable
from pathlib import Path

CONFIG_NAME = "ckptd.toml"  # DIR/ckptd.toml
VOLUME_NAME = "experiments"  # DIR/experiments/, the root

DEMO_CONFIG = """\
# Written by `ckptd demo`. See config.example.toml for every key.
[daemon]
state_dir = "{state}"

[[roots]]
path = "{root}"
quiet_period = "60s"

[roots.retention]
keep_last = 2
keep_best = 1
metric = "eval_loss"
mode = "min"

# Megatron runs here log no eval_loss: keep by recency alone.
[[roots.runs]]
match = "team-a/*"
keep_last = 2
keep_best = 0
"""


def write_zip(path: Path, size: int = 0) -> None:
    """A stand-in for a torch.save file: a valid zip archive, `size` bytes of payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"\0" * size)


def write_model_states(path: Path, dp: int, mp: int = 1, stage: int = 2) -> None:
    """A stand-in for DeepSpeed's model-states file: the plain data ckptd reads, in torch.save's zip shape."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"dp_world_size": dp, "mp_world_size": mp, "ds_config": {"zero_optimization": {"stage": stage}}}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{path.stem}/data.pkl", pickle.dumps(data, protocol=2))


def age(path: Path, mtime: float) -> None:
    """Set the mtime of `path` and everything under it (never by sleeping)."""
    for dirpath, dirnames, filenames in os.walk(path):
        for n in filenames + dirnames:
            os.utime(os.path.join(dirpath, n), (mtime, mtime), follow_symlinks=False)
    os.utime(path, (mtime, mtime), follow_symlinks=False)


def deepspeed_files(world: int, *, stage: int = 2, bf16: bool = False, mp: int = 1) -> list[str]:
    """The file names DeepSpeed writes into global_step<N>/ for this setup."""
    names = []
    opt = "bf16_" if bf16 else ""
    for m in range(mp):
        if stage == 3:
            names += [f"zero_pp_rank_{r}_mp_rank_{m:02d}_model_states.pt" for r in range(world)]
        else:
            names.append(f"mp_rank_{m:02d}_model_states.pt")
        if stage > 0:
            names += [f"{opt}zero_pp_rank_{r}_mp_rank_{m:02d}_optim_states.pt" for r in range(world)]
    return names


def trainer_state(step: int, losses: dict[int, float], best: int | None, run_dir: str = "output") -> dict:
    history = [{"step": s, "eval_loss": v, "epoch": s / 1000} for s, v in sorted(losses.items()) if s <= step]
    return {
        "global_step": step,
        "best_metric": losses.get(best) if best is not None else None,
        "best_model_checkpoint": f"{run_dir}/checkpoint-{best}" if best is not None else None,
        "log_history": history,
    }


def hf_deepspeed_checkpoint(
    run: Path,
    step: int,
    *,
    world: int = 4,
    stage: int = 2,
    losses: dict[int, float] | None = None,
    best: int | None = None,
    skip: Iterable[str] = (),
    shard_size: int = 1024,
    mtime: float | None = None,
) -> Path:
    """`checkpoint-<step>/` as the Trainer writes it under DeepSpeed, minus the files in `skip`."""
    ckpt = run / f"checkpoint-{step}"
    gs = ckpt / f"global_step{step}"
    gs.mkdir(parents=True, exist_ok=True)
    skip = set(skip)
    for name in deepspeed_files(world, stage=stage):
        if name in skip:
            continue
        if name.endswith("model_states.pt"):
            write_model_states(gs / name, world, stage=stage)
        else:
            write_zip(gs / name, shard_size)
    (ckpt / "latest").write_text(f"global_step{step}")
    for r in range(world):
        if f"rng_state_{r}.pth" not in skip:
            write_zip(ckpt / f"rng_state_{r}.pth", 16)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    if "trainer_state.json" not in skip:
        state = trainer_state(step, losses or {}, best, run_dir=str(run))
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
    if mtime is not None:
        age(ckpt, mtime)
    return ckpt


def build(base: Path, now: float) -> Path:
    """The demo volume under `base`, with a config beside it. Returns the config path."""
    root = base / VOLUME_NAME
    run = root / "roberta-mlm"
    losses = {500: 0.91, 1000: 1.02, 1500: 0.97, 2000: 0.95, 2500: 0.93, 3000: 0.99}
    hour = 3600.0
    # The best checkpoint is the oldest: the case in-process rotation got wrong.
    for i, step in enumerate((500, 1000, 1500, 2000)):
        hf_deepspeed_checkpoint(run, step, losses=losses, best=500, mtime=now - (6 - i) * hour)
    # rank 3 never wrote its optimizer shard
    hf_deepspeed_checkpoint(
        run,
        2500,
        losses=losses,
        best=500,
        mtime=now - 2 * hour,
        skip={"zero_pp_rank_3_mp_rank_00_optim_states.pt"},
    )
    # still being written: a recent mtime, the slow rank's shard not there yet
    hf_deepspeed_checkpoint(
        run, 3000, losses=losses, best=500, mtime=now - 5, skip={"zero_pp_rank_2_mp_rank_00_optim_states.pt"}
    )
    mega = root / "team-a" / "gpt-small"
    for i, step in enumerate((1000, 2000, 3000, 4000)):
        it = mega / f"iter_{step:07d}" / "mp_rank_00"
        write_zip(it / "model_optim_rng.pt", 2048)
        age(it.parent, now - (6 - i) * hour)
    (mega / "latest_checkpointed_iteration.txt").write_text("4000")
    config = base / CONFIG_NAME
    config.write_text(DEMO_CONFIG.format(root=root, state=base / "state"))
    return config
