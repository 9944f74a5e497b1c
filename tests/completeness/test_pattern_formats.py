"""A user pattern as strong as a framework module: wildcards beside `{step}`, names ordered by the
time in them, and the modules' whole-file checks in every directory a pattern matches.

The saves are the frameworks' own: transformers' `save_pretrained` in a custom loop
(`save_pretrained(f"ckpt/step_{n}")`, tests/support/fwpretrained.py) killed between two shards and
before its index, judged by `from_pretrained`; torch.save files named as Composer names them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age
from tests.support import child_pythonpath, fwgen
from tests.support.common import run_ckptd

pytestmark = pytest.mark.frameworks


def _plan(cfg: Path) -> dict[str, dict]:
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    return {Path(c["path"]).name: c for c in json.loads(proc.stdout)["checkpoints"]}


def test_a_save_pretrained_killed_between_shards_is_incomplete_whatever_require_says(tmp_path):
    """`require = ["config.json", "*.safetensors"]` is met by 2 of 4 shards, and by 4 of 4 without
    the index, written last; `from_pretrained` refuses both. It had been complete, and keep_last = 1
    would have deleted step_2, the newest loadable save."""
    if (why := fwgen.missing("trainer")) is not None:
        pytest.skip(why)
    vol = tmp_path / "vol"
    made = fwgen.run_module("fwpretrained", str(vol / "ckpt"), "step_1", "step_2", "step_3:3", "step_4:index")
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-3000:]
    truth = json.loads(made.stdout.strip().splitlines()[-1])
    assert [truth[s]["exit"] for s in ("step_1", "step_2", "step_3", "step_4")] == [0, 0, -9, -9]
    assert truth["step_2"]["load"] == "loaded"
    assert truth["step_3"]["load"].startswith("failed") and truth["step_4"]["load"].startswith("failed")
    for s in (1, 2, 3, 4):
        age(vol / "ckpt" / f"step_{s}", time.time() - 3600 + s * 60)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{vol}'\n"
                   "patterns = [{name = 'step_{step}', require = ['config.json', '*.safetensors']}]\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    rows = _plan(cfg)
    assert rows["step_3"]["state"] == "incomplete", rows["step_3"]
    assert any("sharded weights failed: model-00003-of-00004.safetensors missing (2/4 shards)" in r
               for r in rows["step_3"]["reasons"]), rows["step_3"]["reasons"]
    assert rows["step_4"]["state"] == "incomplete", rows["step_4"]
    said = "sharded weights failed: no index naming model-00001-of-00004.safetensors and its 3 siblings"
    assert any(said in r for r in rows["step_4"]["reasons"]), rows["step_4"]["reasons"]
    assert (rows["step_2"]["state"], rows["step_2"]["action"]) == ("complete", "keep")
    assert (rows["step_1"]["state"], rows["step_1"]["action"]) == ("complete", "delete")
    latest = run_ckptd("latest", vol / "ckpt", "-c", cfg)
    assert latest.stdout == f"{vol / 'ckpt' / 'step_2'}\n", latest.stderr


def test_check_config_warns_when_a_require_glob_could_be_met_by_a_partial_save(tmp_path):
    """`*.safetensors` without the index required: a save killed between shards meets it (the
    whole-file checks still hold it incomplete, but the user's evidence says less than they think)."""
    (tmp_path / "vol").mkdir()
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{tmp_path / 'vol'}'\n"
                   "patterns = [{name = 'step_{step}', require = ['config.json', '*.safetensors']},"
                   " {name = 'snap_{step}', require = ['model.safetensors.index.json', '*.safetensors']}]\n")
    proc = run_ckptd("check-config", "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "could be met by a partial save" in line]
    assert len(warned) == 1 and "roots[0].patterns[0]" in warned[0] and "'*.safetensors'" in warned[0], proc.stderr


def test_wildcards_beside_step_take_composer_style_names(tmp_path):
    """`ep*-ba{step}-rank0.pt`: the epoch varies, the batch is the step. A file cut short (a copy
    that died) is incomplete by the torch zip check."""
    import torch

    run = tmp_path / "vol" / "run"
    run.mkdir(parents=True)
    for epoch, batch in ((0, 2), (0, 4), (1, 6), (1, 8)):
        torch.save({"state": {"model": torch.ones(64)}, "batch": batch}, run / f"ep{epoch}-ba{batch}-rank0.pt")
    whole = (run / "ep1-ba8-rank0.pt").read_bytes()
    (run / "ep1-ba8-rank0.pt").write_bytes(whole[: len(whole) // 2])
    age(tmp_path / "vol", time.time() - 3600)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{tmp_path / 'vol'}'\n"
                   "patterns = ['ep*-ba{step}-rank0.pt']\n[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    rows = _plan(cfg)
    assert {n: (r["step"], r["state"], r["action"]) for n, r in rows.items()} == {
        "ep0-ba2-rank0.pt": (2, "complete", "delete"), "ep0-ba4-rank0.pt": (4, "complete", "delete"),
        "ep1-ba6-rank0.pt": (6, "complete", "keep"), "ep1-ba8-rank0.pt": (8, "incomplete", "keep")}
    assert run_ckptd("latest", run, "-c", cfg).stdout == f"{run / 'ep1-ba6-rank0.pt'}\n"


def test_names_without_a_step_are_ordered_by_the_time_in_them(tmp_path):
    """`checkpoint_{time}` over Ray-style `checkpoint_2026-12-01_09-00-00.000000` directories: the
    time in the name orders the saves, not their mtimes (a copy resets those); a save cut short
    (its state pickle truncated) is incomplete, and `latest` names the newest whole one."""
    import pickle

    import torch

    run = tmp_path / "vol" / "exp"
    names = ["checkpoint_2026-12-01_09-00-00.000000", "checkpoint_2026-12-01_10-30-00.000000",
             "checkpoint_2026-12-02_08-15-00.000000", "checkpoint_2026-12-02_11-45-00.000000"]
    for i, name in enumerate(names):
        (run / name).mkdir(parents=True)
        torch.save({"w": torch.ones(8) * i}, run / name / "model.pt")
        (run / name / "extra_state.pkl").write_bytes(pickle.dumps({"epoch": i, "rng": list(range(50))}))
    whole = (run / names[3] / "extra_state.pkl").read_bytes()
    (run / names[3] / "extra_state.pkl").write_bytes(whole[:-5])  # cut short: no STOP opcode
    age(tmp_path / "vol", time.time() - 3600)
    age(run / names[0], time.time() - 600)  # copied back in: the newest mtime, the oldest save
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{tmp_path / 'vol'}'\n"
                   "patterns = [{name = 'checkpoint_{time}', require = ['model.pt']}]\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    rows = _plan(cfg)
    assert {n: (r["state"], r["action"]) for n, r in rows.items()} == {
        names[0]: ("complete", "keep"),  # the newest by time written: kept as such, and said why
        names[1]: ("complete", "delete"), names[2]: ("complete", "keep"), names[3]: ("incomplete", "keep")}
    assert any("whole files failed: extra_state.pkl is a pickle cut short (no STOP opcode at its end)" in r
               for r in rows[names[3]]["reasons"]), rows[names[3]]["reasons"]
    assert run_ckptd("latest", run, "-c", cfg).stdout == f"{run / names[2]}\n"


_SAVE = ("import sys, torch; torch.save({'model': {f't{i}': torch.full((65536,), float(sys.argv[2])) "
         "for i in range(50)}, 'step': int(sys.argv[2])}, sys.argv[1])")


def test_a_torch_save_named_tar_killed_mid_write_is_incomplete(tmp_path):
    """PyTorch's own tutorial names its checkpoints `.tar` (torch.save writes its zip into whatever
    name it is given): `ckpt_{step}.tar`, the third save SIGKILLed from outside (strace, at its third
    write into the file). torch.load refuses it; it had been complete (the engine reads the end of
    `.pt`, `.pth`, `.bin` only), so `latest` named it and keep_last = 1 deleted both loadable saves."""
    if shutil.which("strace") is None:
        pytest.skip("needs strace to SIGKILL the save at a chosen write")
    import torch

    run = tmp_path / "vol" / "run"
    run.mkdir(parents=True)
    for step in (1, 2):
        subprocess.run([sys.executable, "-c", _SAVE, str(run / f"ckpt_{step}.tar"), str(step)], check=True,
                       timeout=120)
    killed = run / "ckpt_3.tar"
    proc = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-P", str(killed), "-e",
                           "trace=write,writev,pwrite64", "-e", "inject=write,writev,pwrite64:signal=KILL:when=3",
                           sys.executable, "-c", _SAVE, str(killed), "3"], timeout=120, capture_output=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    for step in (1, 2):
        assert torch.load(run / f"ckpt_{step}.tar", weights_only=True)["step"] == step
    with pytest.raises(RuntimeError, match="central directory"):
        torch.load(killed, weights_only=True)  # the framework's own verdict
    age(tmp_path / "vol", time.time() - 3600)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{tmp_path / 'vol'}'\n"
                   "patterns = ['ckpt_{step}.tar']\n[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    rows = _plan(cfg)
    assert {n: (r["state"], r["action"]) for n, r in rows.items()} == {
        "ckpt_1.tar": ("complete", "delete"), "ckpt_2.tar": ("complete", "keep"),
        "ckpt_3.tar": ("incomplete", "keep")}, rows
    assert any("whole archives failed: ckpt_3.tar is a zip archive" in r for r in rows["ckpt_3.tar"]["reasons"])
    assert run_ckptd("latest", run, "-c", cfg).stdout == f"{run / 'ckpt_2.tar'}\n"


def test_a_save_pretrained_killed_after_its_config_is_incomplete_whatever_require_says(tmp_path):
    """`require = ["config.json"]` over `save_pretrained(f"ckpt/step_{n}")`, the third save SIGKILLed
    from outside (strace) once config.json, its first file, is written: no weights. from_pretrained refuses
    it; it had been complete, `latest` named it and keep_last = 1 deleted both loadable saves."""
    if (why := fwgen.missing("trainer")) is not None:
        pytest.skip(why)
    if shutil.which("strace") is None:
        pytest.skip("needs strace to SIGKILL the save at a chosen moment")
    vol = tmp_path / "vol"
    made = fwgen.run_module("fwpretrained", str(vol / "ckpt"), "step_1", "step_2")
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-3000:]
    config = vol / "ckpt" / "step_3" / "config.json"
    # killed as it opens generation_config.json, the file after config.json (from_pretrained in the parent
    # reads config.json, and fails on the missing weights before it looks for a generation config)
    proc = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-P", str(config.parent / "generation_config.json"),
                           "-e", "trace=openat", "-e", "inject=openat:signal=KILL:when=1",
                           sys.executable, "-m", "tests.support.fwpretrained",
                           str(vol / "ckpt"), "step_3"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **fwgen._CHILD_ENV, "PYTHONPATH": child_pythonpath()},
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    truth = json.loads(proc.stdout.strip().splitlines()[-1])["step_3"]
    assert truth["exit"] == -9 and truth["load"].startswith("failed"), truth  # from_pretrained's verdict
    assert sorted(p.name for p in config.parent.iterdir()) == ["config.json"]
    for s in (1, 2, 3):
        age(vol / "ckpt" / f"step_{s}", time.time() - 3600 + s * 60)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{vol}'\n"
                   "patterns = [{name = 'step_{step}', require = ['config.json']}]\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    rows = _plan(cfg)
    assert {n: (r["state"], r["action"]) for n, r in rows.items()} == {
        "step_1": ("complete", "delete"), "step_2": ("complete", "keep"), "step_3": ("incomplete", "keep")}, rows
    assert any("model weights failed: a gpt2 model's config.json and no weights beside it" in r
               for r in rows["step_3"]["reasons"]), rows["step_3"]["reasons"]
    assert run_ckptd("latest", vol / "ckpt", "-c", cfg).stdout == f"{vol / 'ckpt' / 'step_2'}\n"
