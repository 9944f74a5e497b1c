"""A DCP directory inside another framework's save is checked as strictly as a DCP save at the top:
its `.metadata` read with the restricted unpickler, and every file its storage_data names a regular
file reaching the furthest byte it names (frameworks/dcp.py `storage_checks`), not only the
`.metadata` being there.

The save: a real accelerate `save_state` checkpoint, with a real DCP directory written into its
`pytorch_model_fsdp_0/` by `torch.distributed.checkpoint.save` (tests/support/fwdcp_nested.py).
accelerate's FSDP (SHARDED_STATE_DICT, which writes that directory through DCP's FileSystemWriter:
utils/fsdp_utils.py save_fsdp_model) cannot run on the CPU here, so DCP's writer is called directly.
Each verdict is checked against `dcp.load` on the same directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import fwgen
from tests.support.common import run_ckptd
from tests.support.fwfixtures import copy_volume

pytestmark = pytest.mark.frameworks
SHARD = "pytorch_model_fsdp_0/__0_1.distcp"


def _child(*args: str) -> subprocess.CompletedProcess[str]:
    return fwgen.run_module("fwdcp_nested", *args)


@pytest.fixture(scope="module")
def nested(tmp_path_factory) -> Path:
    if (why := fwgen.missing("accelerate")) is not None:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("dcp-nested")
    proc = _child("save", str(out))
    assert proc.returncode == 0 and "saved" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def _verify(ckpt: Path) -> subprocess.CompletedProcess[str]:
    return run_ckptd("verify", ckpt, env={"CKPTD_CONFIG": ""})


@pytest.fixture(scope="module")
def _loader(tmp_path_factory):
    """One `fwdcp_nested serve` for the module: each `_loads` is the `load` it ran as a process of its
    own, without importing torch again."""
    err = tmp_path_factory.mktemp("dcp-loader") / "stderr"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.fwdcp_nested", "serve"], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                env={**os.environ, **fwgen._CHILD_ENV})
    with proc:  # closes its pipes and waits for it, which ends when its stdin does
        yield proc, err
        proc.stdin.close()


@pytest.fixture
def _loads(_loader) -> Callable[[Path], bool]:
    proc, err = _loader

    def loads(ckpt: Path) -> bool:
        """dcp.load of the checkpoint's model part, compared with what was saved (fwdcp_nested.load)."""
        proc.stdin.write(f"{ckpt}\n")
        proc.stdin.flush()
        said = []
        while not (line := proc.stdout.readline()).startswith("rc ") and line:
            said.append(line)
        code = int(line.split()[1]) if line else None
        assert code in (0, 1), "".join(said)[-2000:] + err.read_text()[-3000:]
        return code == 0 and "loaded\n" in said
    return loads


def test_the_whole_nested_dcp_save_is_complete(nested, _loads, tmp_path):
    root = copy_volume({"out_dir": nested}, tmp_path / "vol")
    ckpt = root / "run" / "checkpoint_0"
    assert sorted(os.listdir(ckpt / "pytorch_model_fsdp_0")) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    proc = _verify(ckpt)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dcp storage (pytorch_model_fsdp_0/.metadata)" in proc.stdout
    assert _loads(ckpt)


@pytest.mark.parametrize("how", ["cut short", "missing"])
def test_a_nested_shard_cut_short_or_missing_is_incomplete(nested, _loads, tmp_path, how):
    """The `.metadata` is there (all the old check asked), but one of the two data files it names
    is cut short (a copy or write interrupted) or gone: dcp.load fails, and so must the verdict."""
    root = copy_volume({"out_dir": nested}, tmp_path / "vol")
    ckpt = root / "run" / "checkpoint_0"
    shard = ckpt / SHARD
    st = os.stat(shard.parent)
    if how == "missing":
        shard.unlink()
    else:
        os.truncate(shard, shard.stat().st_size // 2)
        os.utime(shard, (st.st_mtime, st.st_mtime))
    os.utime(shard.parent, (st.st_atime, st.st_mtime))  # aged still: only the evidence can tell
    proc = _verify(ckpt)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "incomplete" in proc.stdout, proc.stdout
    why = "cut short" if how == "cut short" else "missing (pytorch_model_fsdp_0/.metadata names it; dcp.load fails)"
    assert SHARD in proc.stdout and why in proc.stdout, proc.stdout
    assert not _loads(ckpt)


def test_a_nested_dcp_directory_with_every_data_file_gone_is_incomplete(nested, _loads, tmp_path):
    """Both data files gone, the `.metadata` naming them left (a cleanup by `*.distcp`, a copy that
    skipped them): the directory still is a DCP save, told by its metadata, not by its `*.distcp`
    alone (frameworks/dcp.py `is_metadata`). dcp.load fails; the checkpoint is not complete."""
    root = copy_volume({"out_dir": nested}, tmp_path / "vol")
    ckpt = root / "run" / "checkpoint_0"
    part = ckpt / "pytorch_model_fsdp_0"
    st = os.stat(part)
    for shard in part.glob("*.distcp"):
        shard.unlink()
    os.utime(part, (st.st_atime, st.st_mtime))  # aged still: only the evidence can tell
    assert sorted(os.listdir(part)) == [".metadata"]
    proc = _verify(ckpt)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "incomplete" in proc.stdout, proc.stdout
    why = "pytorch_model_fsdp_0/__0_0.distcp missing (pytorch_model_fsdp_0/.metadata names it; dcp.load fails)"
    assert "dcp storage (pytorch_model_fsdp_0/.metadata)" in proc.stdout and why in proc.stdout, proc.stdout
    assert not _loads(ckpt)


def test_prune_refuses_a_checkpoint_named_as_its_root(nested, _loads, tmp_path):
    """`ckptd prune --keep-last 1 CHECKPOINT` with no config: seen from the checkpoint itself, its two
    DCP directories (FSDP's SHARDED_STATE_DICT writes the model's and the optimizer's, each through
    DCP: accelerate utils/fsdp_utils.py save_fsdp_model / save_fsdp_optimizer) look like a run of two
    checkpoints, and the older, the model's weights, was moved into a trash made inside the checkpoint
    and purged. A root that is a checkpoint, or lies in one, is refused (planner.Scanner
    `check_root_is_no_checkpoint`), as a configured root's subtree inside a run is; nothing moves.
    optimizer_0/ here is the real DCP save copied under the optimizer's name (FSDP cannot run on the
    CPU)."""
    root = copy_volume({"out_dir": nested}, tmp_path / "vol")
    ckpt = root / "run" / "checkpoint_0"
    subprocess.run(["cp", "-rp", str(ckpt / "pytorch_model_fsdp_0"), str(ckpt / "optimizer_0")], check=True)
    old = os.stat(ckpt / "pytorch_model_fsdp_0").st_mtime - 60
    os.utime(ckpt / "pytorch_model_fsdp_0", (old, old))  # the older of the two "checkpoints"
    before = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))
    env = {"CKPTD_CONFIG": "", "XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path / "home")}
    proc = run_ckptd("prune", "--keep-last", "1", ckpt, env=env)
    assert proc.returncode == 64, proc.stdout + proc.stderr
    assert f"{ckpt} is a checkpoint: name its run or a directory above it" in proc.stderr, proc.stderr
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) == before
    assert _loads(ckpt)
    # a directory inside it: the DCP part is a checkpoint of its own, as DCP sees it; deeper, ckptd's
    # own directory of the checkpoint is inside one
    (ckpt / "sub").mkdir()
    for inner, said in ((ckpt / "pytorch_model_fsdp_0", "is a checkpoint"),
                        (ckpt / "sub", f"is inside the checkpoint {ckpt}")):
        proc = run_ckptd("prune", "--keep-last", "1", inner, env=env)
        assert proc.returncode == 64 and f"{inner} {said}: name its run" in proc.stderr, proc.stderr
    (ckpt / "sub").rmdir()
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) == before


def test_the_daemon_and_check_config_refuse_a_checkpoint_configured_as_a_root(nested, _loads, tmp_path):
    """The same refusal for a root in the config: `ckptd run` exits 64 before it makes a lock, a
    lease or a trash there, and `check-config` says why with the same code (cli preflight)."""
    root = copy_volume({"out_dir": nested}, tmp_path / "vol")
    ckpt = root / "run" / "checkpoint_0"
    before = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{ckpt}'\n"
                   "[roots.retention]\nkeep_last = 1\n")
    for command in (("run", "--foreground"), ("check-config",)):
        proc = run_ckptd(*command, "-c", cfg, timeout=60)
        assert proc.returncode == 64, (command, proc.stdout + proc.stderr)
        assert f"{ckpt} is a checkpoint: name its run or a directory above it" in proc.stderr, proc.stderr
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) == before
    assert _loads(ckpt)


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_symlink_to_a_checkpoint_is_refused_as_a_root_as_the_checkpoint_is(nested, _loads, tmp_path, where):
    """`ln -s vol/run/checkpoint_0 link; ckptd prune --keep-last 1 link` (the link beside the volume
    or inside it), and a config whose root is the link: the walk follows the link into the
    checkpoint, so the refusal asks of what it points to. It had taken the link's own name, which
    names no checkpoint, and trashed the model's DCP part out of the run's only checkpoint."""
    root = copy_volume({"out_dir": nested}, tmp_path / "vol")
    ckpt = root / "run" / "checkpoint_0"
    subprocess.run(["cp", "-rp", str(ckpt / "pytorch_model_fsdp_0"), str(ckpt / "optimizer_0")], check=True)
    old = os.stat(ckpt / "pytorch_model_fsdp_0").st_mtime - 60
    os.utime(ckpt / "pytorch_model_fsdp_0", (old, old))
    before = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))
    link = (tmp_path / "link") if where == "outside" else (root / "link")
    link.symlink_to(ckpt)
    env = {"CKPTD_CONFIG": "", "XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path / "home")}
    proc = run_ckptd("prune", "--keep-last", "1", link, env=env)
    assert proc.returncode == 64 and f"{link} is a checkpoint: name its run" in proc.stderr, proc.stdout + proc.stderr
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{link}'\n"
                   "[roots.retention]\nkeep_last = 1\n")
    for command in (("check-config",), ("plan",), ("prune",)):
        proc = run_ckptd(*command, "-c", cfg, env={"CKPTD_CONFIG": ""})
        assert proc.returncode == 64, (command, proc.stdout + proc.stderr)
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) == before
    assert _loads(ckpt)


def test_a_save_into_a_directory_of_the_users_naming_is_no_run_of_its_parts(nested, _loads, tmp_path):
    """accelerate's `save_state("final")` (a name of the user's, not checkpoint_N) under a root: its
    DCP parts, `pytorch_model_fsdp_0/` and `optimizer_0/`, look like two DCP checkpoints of a run
    `proj/final`, and keep_last=1 had deleted the model's part. Every process's
    random_states_<i>.pkl says the directory is one accelerate save (`unnamed_save`): no run, nothing
    in it deleted, and the daemon's log says so."""
    root = copy_volume({"out_dir": nested}, tmp_path / "vol")
    final = root / "proj" / "final"
    final.parent.mkdir()
    os.rename(root / "run" / "checkpoint_0", final)
    assert any(n.startswith("random_states_") for n in os.listdir(final))
    subprocess.run(["cp", "-rp", str(final / "pytorch_model_fsdp_0"), str(final / "optimizer_0")], check=True)
    old = os.stat(final / "pytorch_model_fsdp_0").st_mtime - 60
    os.utime(final / "pytorch_model_fsdp_0", (old, old))
    before = sorted(str(p.relative_to(final)) for p in final.rglob("*"))
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    plan = run_ckptd("plan", "-c", cfg, "--json", env={"CKPTD_CONFIG": ""})
    assert plan.returncode == 0, plan.stderr
    assert [c["path"] for c in json.loads(plan.stdout)["checkpoints"] if "proj/final" in c["path"]] == []
    assert f"{final} holds one accelerate save (under a name of the user's)" in plan.stderr, plan.stderr
    proc = run_ckptd("prune", "-c", cfg, env={"CKPTD_CONFIG": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(str(p.relative_to(final)) for p in final.rglob("*")) == before
    assert _loads(final)
