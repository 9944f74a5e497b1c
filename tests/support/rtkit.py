"""What the reproductions of ways to break ckptd's promise share (tests/policy/test_pins.py,
tests/removal/test_trash.py, tests/discovery/test_resume_pointers.py and their neighbours): configs
for one root with no quiet period, a prune that must succeed, the DeepSpeed skip, and the small
real volumes they start from."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from tests.support.common import run_ckptd
from tests.support.fwfixtures import copy_volume

OLD = time.time() - 86400  # a day ago: every quiet period is over

no_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("torch") is None,
    reason="needs ckptd[deepspeed] (torch==2.13.0, deepspeed)",
)


def config(tmp_path: Path, root: Path, *, root_extra: str = "", **retention) -> Path:
    path = tmp_path / "ckptd.toml"
    lines = [f"[daemon]\nstate_dir = '{tmp_path / 'state'}'",
             f"[[roots]]\npath = '{root}'\nquiet_period = '0s'\nallow_short_quiet_period = true\n{root_extra}", "[roots.retention]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in retention.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def config_file(tmp_path: Path, root: Path, body: str = "", retention: str = "keep_last = 1\nkeep_best = 0") -> Path:
    path = tmp_path / "ckptd.toml"
    path.write_text(
        f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\nquiet_period = '0s'\nallow_short_quiet_period = true\n"
        f"world_size = 2\n{body}\n[roots.retention]\n{retention}\n"
    )
    return path


def prune(cfg: Path, *args: str | Path) -> str:
    proc = run_ckptd("prune", "-c", cfg, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def demo_config(tmp_path: Path, **retention: object) -> tuple[Path, Path]:
    """`ckptd demo` (Trainer+DeepSpeed and Megatron runs), quiet_period 0s: (config, root)."""
    proc = run_ckptd("demo", tmp_path / "demo")
    assert proc.returncode == 0, proc.stderr
    cfg = tmp_path / "demo" / "ckptd.toml"
    text = cfg.read_text().replace(
        'quiet_period = "60s"', 'quiet_period = "0s"\nallow_short_quiet_period = true')
    for k, v in retention.items():
        text = text.replace("[roots.retention]\n", f"[roots.retention]\n{k} = {json.dumps(v)}\n", 1)
    cfg.write_text(text)
    return cfg, tmp_path / "demo" / "experiments"


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if not p.name.startswith("."))


def actions(plan_json: str) -> dict[str, str]:
    return {"/".join(c["path"].split("/")[-2:]): c["action"] for c in json.loads(plan_json)["checkpoints"]}


def bare_deepspeed_run(run: Path, steps: tuple[int, ...]) -> None:
    """global_step<N>/ directly in the run (save_checkpoint(run_dir)), from demo.py's look-alikes."""
    for i, step in enumerate(steps):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD + i)
        os.rename(run / f"checkpoint-{step}" / f"global_step{step}", run / f"global_step{step}")
        shutil.rmtree(run / f"checkpoint-{step}")


def dcp_save(path: Path, step: int) -> None:
    """A real torch.distributed.checkpoint save (one process, no process group: DCP's no-dist path)."""
    code = ("import sys, torch, torch.distributed.checkpoint as dcp;"
            "dcp.save({'w': torch.full((64,), float(sys.argv[2])), 'step': int(sys.argv[2])},"
            " checkpoint_id=sys.argv[1])")
    proc = subprocess.run([sys.executable, "-c", code, str(path), str(step)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.skip(f"torch.distributed.checkpoint cannot save here: {proc.stderr[-300:]}")
    assert (path / ".metadata").is_file()


def trainer_run(trainer_volume, tmp_path: Path) -> tuple[Path, Path]:
    """The Trainer's run-state: checkpoint-2..8 complete (eval_loss 0.9, 0.6, 0.4, 0.7: the best is
    checkpoint-6, as checkpoint-8's trainer_state.json says), checkpoint-10 killed before its own."""
    root = copy_volume(trainer_volume, tmp_path / "vol")
    return root, root / "run-state"


def rename_best(ckpt: Path, old: str, new: str) -> None:
    """Rewrite `ckpt`'s trainer_state.json in place (same inode, same size) naming `new` as the
    best checkpoint, its mtime kept (`cp -p`, `touch -r`): only its ctime changes."""
    state = ckpt / "trainer_state.json"
    st = state.stat()
    text = state.read_text()
    assert len(old) == len(new) and old in text
    with open(state, "r+") as f:
        f.write(text.replace(f"/{old}", f"/{new}"))
    os.utime(state, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = state.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert json.loads(state.read_text())["best_model_checkpoint"].endswith(f"/{new}")
