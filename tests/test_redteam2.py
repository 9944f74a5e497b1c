"""Red team, second round: reproductions of ways to make ckptd delete what its promise protects.

Each test drives the real CLI (`ckptd plan`/`prune` as subprocesses) on real files. Each failed on
the code it was written against (ef2812c), marked `xfail(strict=True)` while its hole was open;
every hole is fixed now, and the test keeps the fix.
Hand-made look-alikes (ckptd.demo's DeepSpeed stand-ins) only where the state needs no framework
to show the hole, and the test says so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.demo import age, deepspeed_files, hf_deepspeed_checkpoint, write_model_states, write_zip
from tests.support.common import run_ckptd
from tests.support.rtkit import config, no_deepspeed, prune

OLD = time.time() - 86400  # a day ago: every quiet period is over



def bare_deepspeed(run: Path, step: int, *, world: int = 2, mtime: float | None = None) -> Path:
    """A bare `global_step<N>/` as DeepSpeed's save_checkpoint names its files (ckptd.demo's
    stand-ins: valid zips, the model states holding the world sizes ckptd reads)."""
    gs = run / f"global_step{step}"
    for name in deepspeed_files(world):
        if name.endswith("model_states.pt"):
            write_model_states(gs / name, world)
        else:
            write_zip(gs / name, 64)
    if mtime is not None:
        age(gs, mtime)
    return gs




# --- 1. The configured root reached through a bind mount is a root of its own -----------------


@pytest.mark.parametrize("which", ["the root", "a run's parent inside it"])
def test_a_root_reached_through_a_bind_mount_keeps_its_pins(tmp_path, mount, which):
    """The config's root is /vol with `pins = ['team/run/checkpoint-1']`; the same volume is
    bind-mounted at /mnt (a container's or another node's path for it, or `mount --bind` to give
    a team its own path). `ckptd prune -c cfg /mnt` (or /mnt/team) is the configured root by
    every measure the kernel has (same device, same inode), but ckptd recognises another spelling
    of a root only through symlinks and `..`: it takes /mnt for a root of its own with the
    built-in defaults, no pins, and a lock of its own (so not even the daemon holding /vol stops
    it). keep_last=2 then deletes the pinned checkpoint-1."""
    root = tmp_path / "vol"
    run = root / "team" / "run"
    for step in (1, 2, 3, 4):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD + step)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0, pins=["team/run/checkpoint-1"])
    assert "keep" in run_ckptd("plan", "-c", cfg).stdout.splitlines()[1], "the pin holds on the root's own path"
    other = tmp_path / "mnt"
    other.mkdir()
    mount("--bind", root, other)
    assert (other / "team" / "run" / "checkpoint-1").is_dir()
    prune(cfg, other if which == "the root" else other / "team")
    assert (run / "checkpoint-1").is_dir(), "the pinned checkpoint-1 was deleted through the bind mount's path"


def test_located_in_sees_a_bind_mount_by_identity_and_by_the_mount_table(tmp_path, mount):
    """The two ways `mounts.located_in` sees a bind mount: walking up to the root's identity
    (works without the mount table: /proc unreadable) and, for a bind of a directory inside the
    root, the mount table (confirmed by identity). A directory elsewhere is in neither."""
    from ckptd.mounts import located_in, read_mounts

    root = tmp_path / "vol"
    (root / "team" / "run").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    whole, part = tmp_path / "mnt", tmp_path / "mnt-team"
    whole.mkdir()
    part.mkdir()
    mount("--bind", root, whole)
    mount("--bind", root / "team", part)
    assert located_in(whole / "team" / "run", root, []) == "team/run"
    assert located_in(whole, root, []) == "."
    assert located_in(part / "run", root, read_mounts()) == "team/run"
    assert located_in(part / "run", root, []) is None  # no table: a bind of a subdirectory is not seen
    assert located_in(tmp_path / "elsewhere", root, read_mounts()) is None
    assert located_in(root, part, read_mounts()) is None  # the root holds the bind, it is not inside it


# --- 2. DeepSpeed's `latest` holding an absolute path as the trainer's node mounts the volume --


def test_an_absolute_latest_through_another_mount_point_is_kept(tmp_path):
    """A user rolls a DeepSpeed run back by writing the tag's absolute path into `latest`, as the
    training node mounts the volume: /data/ckpt/run/global_step10. DeepSpeed's load_checkpoint
    does os.path.join(load_dir, tag), which is the absolute path itself: on the trainer's node it
    resumes from global_step10. ckptd's host (a sidecar, another node) mounts the volume at
    another path; pointer_target resolves the absolute path, finds it outside the run, and
    concludes the pointer names nothing here, not that it cannot tell. keep_last=1 deletes
    global_step10, the checkpoint the next resume loads. (An absolute pointer whose target ckptd
    cannot see should keep, in doubt, what it may name: at least the tag of the same name.)"""
    root = tmp_path / "vol"
    run = root / "run"
    for step in (10, 20, 30):
        bare_deepspeed(run, step, mtime=OLD + step)
    (run / "latest").write_text("/data/ckpt/run/global_step10\n")
    age(run / "latest", OLD + 40)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    prune(cfg)
    assert (run / "global_step10").is_dir(), "`latest` names global_step10 (another mount's path), and it was deleted"


# --- 3. A run of torch.distributed.checkpoint saves written inside a Trainer checkpoint ---------


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


def test_a_dcp_run_written_inside_a_checkpoint_is_not_deleted_with_it(tmp_path):
    """The red team's item 2 again, with torch.distributed.checkpoint: a fine-tuning script given
    `--output_dir out/checkpoint-500` (the checkpoint it starts from) saves its own steps there
    with dcp.save as step_10/, step_20/ (ckptd's `dcp` layout: 'the last number in the name').
    layouts.held counts DCP directories nowhere, as parts of the checkpoint (FSDP's
    pytorch_model_fsdp_0/), and the evidence's own DCP check passes them ('.metadata present').
    So checkpoint-500 is one complete old checkpoint of `out`: once the outer job saves again,
    keep_last deletes it, and the nested run's every save, its newest included, goes with it.
    (The same nested run at the top of a root is two checkpoints ckptd keeps the newest of.)
    Real DCP files (dcp.save in one process); the Trainer's checkpoints are ckptd.demo's."""
    root = tmp_path / "vol"
    out = root / "out"
    for step in (500, 1000, 1500):
        hf_deepspeed_checkpoint(out, step, world=2, mtime=OLD + step)
    nested = out / "checkpoint-500"
    for step in (10, 20):
        dcp_save(nested / f"step_{step}", step)
        age(nested / f"step_{step}", OLD + 3000 + step)
    os.utime(nested, (OLD + 3020, OLD + 3020))
    hf_deepspeed_checkpoint(out, 2000, world=2, mtime=OLD + 4000)  # the outer job saved again, later
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    prune(cfg)
    assert (nested / "step_20").is_dir(), "the nested DCP run's newest save was deleted with checkpoint-500"


# --- near-miss: a pin spelled through a symlink to the root is refused as "never matches" ------


def test_an_absolute_pin_through_a_symlink_to_the_root_pins(tmp_path):
    """The root is configured as its real path, /data/vol; users know it by the symlink the
    cluster provides, /vol -> /data/vol, and pin `/vol/team/run/checkpoint-1`. ckptd compares
    the pin with the root lexically: 'not under the root: it would never match', exit 78, so
    every command (and the daemon) refuses the config, though the pin names a checkpoint under
    the root by any measure the kernel has. The other way round (the root configured through the
    symlink, the pin as the real path) is accepted and pins. Nothing is deleted (the refusal is
    loud), hence a near-miss: the daemon does not start after a reload of such a pin list
    (the old config stays in force), and `prune` from cron stops running."""
    real = tmp_path / "data" / "vol"
    run = real / "team" / "run"
    for step in (1, 2, 3):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD + step)
    link = tmp_path / "vol"
    link.symlink_to(real)
    cfg = config(tmp_path, real, keep_last=1, keep_best=0, pins=[f"{link}/team/run/checkpoint-1"])
    proc = run_ckptd("plan", "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if " checkpoint-1 " in line)
    assert "pinned" in row, row


def test_configured_roots_overlapping_through_a_bind_mount_are_refused(tmp_path, mount):
    """Roots that overlap as written (`/vol` and `/vol/team`) are a config error (78: 'overlaps').
    The same overlap through a bind mount (team-a's directory also mounted at /mnt/team, as the
    team's jobs see it, and configured as a root of its own with the defaults) is accepted:
    check-config says OK, and `prune` plans each root apart. /mnt/team's pass (keep_last=2)
    deletes checkpoint-1, which /vol's retention pins; /vol's own pass then warns that its pin
    matches nothing. Two deleters of one run, each with its own rules, and the pin lost."""
    root = tmp_path / "vol"
    run = root / "team" / "run"
    for step in (1, 2, 3, 4):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD + step)
    other = tmp_path / "mnt"
    other.mkdir()
    mount("--bind", root / "team", other)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(
        f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n"
        f"[[roots]]\npath = '{other}'\nquiet_period = '0s'\nallow_short_quiet_period = true\n"
        f"[[roots]]\npath = '{root}'\nquiet_period = '0s'\nallow_short_quiet_period = true\n"
        "[roots.retention]\nkeep_last = 1\nkeep_best = 0\npins = ['team/run/checkpoint-1']\n"
    )
    proc = run_ckptd("prune", "-c", cfg)
    if proc.returncode == 78:  # refused, as the lexical overlap is: the fix
        assert "overlaps" in proc.stderr and str(other) in proc.stderr and str(root) in proc.stderr, proc.stderr
        return
    assert (run / "checkpoint-1").is_dir(), "checkpoint-1, pinned by /vol's retention, was deleted through /mnt"


# --- 4. Lightning's DeepSpeed checkpoint directory: no census of its shards ----------------------


@pytest.mark.deepspeed
@no_deepspeed
def test_a_lightning_deepspeed_checkpoint_missing_a_shard_is_not_complete(zero3_bf16_bare, tmp_path):
    """Lightning's DeepSpeedStrategy saves each checkpoint as a *directory* named like the file
    (`epoch=1-step=20.ckpt/`): `deepspeed_engine.save_checkpoint(filepath, tag="checkpoint")`, so
    the shards are in `<name>.ckpt/checkpoint/` and `latest` says `checkpoint`
    (lightning/pytorch/strategies/deepspeed.py save_checkpoint). ckptd takes the directory for a
    Lightning checkpoint and checks only quiet, NeMo's marker and the files' integrity: the
    DeepSpeed census (every rank's optimizer shard, from the model states' world sizes) runs for
    `global_step*` tags in Trainer checkpoints, bare runs and accelerate's tag directories, never
    here. With rank 1's shard missing (rank 1 killed mid-save, or still on its way: nothing of
    it in the directory yet), step 20 is 'complete', the newest, and keep_last=1 deletes step 10,
    the only checkpoint that can be resumed. Real DeepSpeed files (ZeRO-3 bf16, 2 ranks, from
    dsgen) in the directory Lightning puts them in; Lightning's DeepSpeedStrategy needs CUDA, so
    the directory is laid out by hand as deepspeed.py lays it out."""
    root = tmp_path / "vol"
    ckpts = root / "team" / "run" / "lightning_logs" / "version_0" / "checkpoints"
    for epoch, step in enumerate((10, 20)):
        d = ckpts / f"epoch={epoch}-step={step}.ckpt"
        shutil.copytree(zero3_bf16_bare / f"global_step{step}", d / "checkpoint")
        (d / "latest").write_text("checkpoint")
    killed = ckpts / "epoch=1-step=20.ckpt" / "checkpoint"
    shards = sorted(killed.glob("*zero_pp_rank_1_*optim_states.pt"))
    assert shards, sorted(p.name for p in killed.iterdir())
    for p in shards:
        p.unlink()
    age(root, OLD)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    proc = run_ckptd("plan", "-c", cfg)
    row = next(line for line in proc.stdout.splitlines() if "step=20" in line)
    prune(cfg)
    assert (ckpts / "epoch=0-step=10.ckpt").is_dir(), f"the last whole checkpoint was deleted; step 20: {row}"


# --- near-miss: Lightning's FSDP sharded checkpoints are megatron-core ones missing metadata.json -


def test_lightning_fsdp_sharded_checkpoints_can_be_complete(tmp_path):
    """Lightning's FSDPStrategy with state_dict_type="sharded" saves each checkpoint as a directory
    named like the file (`epoch=0-step=100.ckpt/`): torch.distributed.checkpoint's files, then
    rank 0's `meta.pt` (lightning/pytorch/strategies/fsdp.py save_checkpoint,
    _distributed_checkpoint_save, _METADATA_FILENAME). ckptd takes a Lightning-named directory of
    DCP files for a NeMo/megatron-core distributed checkpoint and demands megatron-core's
    `metadata.json`, which Lightning never writes: every such checkpoint is 'incomplete' for
    ever. Nothing is deleted (safe), but nothing is ever freed either, and `plan` blames a file
    of another framework. Real DCP files (dcp.save, one process) and a real torch.save meta.pt,
    laid out as fsdp.py lays them out; Lightning refuses FSDP on the CPU, so it cannot write them
    here itself."""
    root = tmp_path / "vol"
    ckpts = root / "team" / "run" / "lightning_logs" / "version_0" / "checkpoints"
    code = ("import sys, torch; torch.save({'epoch': int(sys.argv[2]), 'global_step': int(sys.argv[3])},"
            " sys.argv[1])")
    for epoch, step in enumerate((100, 200)):
        d = ckpts / f"epoch={epoch}-step={step}.ckpt"
        dcp_save(d, step)
        subprocess.run([sys.executable, "-c", code, str(d / "meta.pt"), str(epoch), str(step)], check=True,
                       timeout=120)
        age(d, OLD + step)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    proc = run_ckptd("plan", "-c", cfg)
    rows = [line for line in proc.stdout.splitlines() if ".ckpt" in line]
    assert len(rows) == 2 and all(" complete " in r for r in rows), proc.stdout


def test_a_lightning_fsdp_sharded_checkpoint_without_dcp_metadata_is_not_complete(tmp_path):
    """The other side of the one above: Lightning's FSDP checkpoint directory is complete by DCP's
    evidence, so without `.metadata` (the coordinator's, written after every rank's data) it is
    not, `meta.pt` or not. Real DCP files and meta.pt; `.metadata` removed by hand (a state no
    save leaves, meta.pt being written after it: the check must not lean on meta.pt alone)."""
    root = tmp_path / "vol"
    ckpts = root / "run" / "checkpoints"
    d = ckpts / "epoch=0-step=100.ckpt"
    dcp_save(d, 100)
    code = "import sys, torch; torch.save({'epoch': 0, 'global_step': 100}, sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(d / "meta.pt")], check=True, timeout=120)
    (d / ".metadata").unlink()
    age(root, OLD)
    proc = run_ckptd("plan", "-c", config(tmp_path, root, keep_last=1, keep_best=0))
    row = next(line for line in proc.stdout.splitlines() if "step=100" in line)
    assert " complete " not in row and ".metadata missing" in proc.stdout, proc.stdout


# --- 5. Lightning's last.ckpt as a link: its target is what ckpt_path="last" loads ---------------

_LIGHTNING_LINK_JOB = """
import sys, torch, lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
class M(L.LightningModule):
    def __init__(self):
        super().__init__(); self.l = torch.nn.Linear(4, 1)
    def training_step(self, b, i):
        self.log("m", float(self.global_step))  # worse at every step: the first save stays the best
        return self.l(b[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
d = sys.argv[1]
best = ModelCheckpoint(dirpath=d, filename="best-{epoch}-{step}", monitor="m", mode="min", save_top_k=1,
                       save_last="link", every_n_train_steps=2)
periodic = ModelCheckpoint(dirpath=d, filename="{epoch}-{step}", save_top_k=-1, every_n_train_steps=2)
t = L.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[best, periodic], logger=False,
              enable_progress_bar=False, enable_model_summary=False)
t.fit(M(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4))
"""


def test_the_target_of_lightnings_last_link_is_kept(tmp_path):
    """Lightning's ModelCheckpoint(save_last="link") makes last.ckpt a symlink to the file it saved
    last, instead of a copy (lightning/pytorch/callbacks/model_checkpoint.py _save_last_checkpoint,
    _link_checkpoint). With a top-k callback on a metric beside a periodic one (the usual pair),
    the top-k callback saves nothing once the metric stops improving, and its last.ckpt keeps
    pointing at its best file, `best-epoch=0-step=2.ckpt`, while the periodic callback writes
    newer steps beside it. ckptd never deletes last.ckpt itself ('what ckpt_path="last" loads'),
    but the file the link names is an ordinary old step: keep_last (the defaults too) deletes it,
    last.ckpt dangles, and `Trainer.fit(ckpt_path="last")` has nothing to load. Real Lightning
    files: a 6-step CPU fit with the two callbacks."""
    ckpts = tmp_path / "vol" / "run" / "checkpoints"
    proc = subprocess.run([sys.executable, "-c", _LIGHTNING_LINK_JOB, str(ckpts)], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"lightning cannot run here: {proc.stderr[-300:]}")
    target = os.readlink(ckpts / "last.ckpt")
    assert target == "best-epoch=0-step=2.ckpt", target
    assert any(p.name == "epoch=0-step=6.ckpt" for p in ckpts.iterdir())
    age(tmp_path / "vol", OLD)
    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    prune(cfg)
    assert (ckpts / "last.ckpt").resolve().is_file(), f"last.ckpt -> {target}, which was deleted"


# --- near-miss: a prune with another state_dir deletes beside the daemon that leads the root -----


def test_a_prune_with_another_state_dir_waits_for_the_daemon_leading_the_root(tmp_path):
    """README: one deleter per root; `prune` takes the same lock as the daemon and exits 75 while a
    live ckptd holds it. With `leadership = "auto"` on a local filesystem the lock is
    `state_dir/locks/<hash of the root>.lock`: a daemon run from the packaged unit
    (state_dir /var/lib/ckptd) and a `ckptd prune` from a user's cron with a config of its own
    (its own state_dir), or a docker sidecar with its own state volume beside a host unit, hold
    different locks on the same root. The prune goes ahead and deletes while the daemon leads (its
    plan, consolidations and trash at the same time), each journalling in its own state_dir.
    Nothing protected is deleted by this alone (each deleter re-checks), hence a near-miss."""
    from tests.support.daemonproc import DaemonProc, write_config

    root = tmp_path / "vol"
    for step in (1, 2, 3):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=OLD + step)
    daemon_cfg = write_config(tmp_path / "daemon.toml", root, tmp_path / "state-daemon",
                              root_extra="quiet_period = '1h'", retention="keep_last = 1\nkeep_best = 0")
    cron_cfg = config(tmp_path, root, keep_last=1, keep_best=0)  # state_dir tmp_path/state
    with DaemonProc("-c", daemon_cfg) as daemon:
        daemon.wait_message("this ckptd deletes here", timeout=60)
        proc = run_ckptd("prune", "-c", cron_cfg)
    assert proc.returncode == 75, f"prune ran beside the leading daemon (exit {proc.returncode}):\n{proc.stdout}"


# --- 6. Rewriting trainer_state.json in every checkpoint moves every save time ------------------


def test_trainer_state_rewritten_in_place_does_not_unprotect_the_newest_save(tmp_path):
    """Red team item 7 with a file the Trainer does save. A run resumed from checkpoint-3000 (4000
    and 5000 diverged) saved checkpoint-3500: 'written last', kept. Then the run is moved
    (`mv out /vol/archive/out`) and, as the Trainer's `best_model_checkpoint` holds the old path,
    the paths are fixed with `sed -i` over `*/trainer_state.json` (shell order: 3000, 3500, 4000,
    5000). sed -i writes a new file and renames it over the old one: every trainer_state.json now
    has the time of the fix, in name order, so checkpoint-5000 is both the newest by step and
    'written last'; `one_save` is content (trainer_state.json is newest in each). keep_last=2
    keeps 5000 and 4000 and deletes checkpoint-3500, the resumed job's only save. The mtimes of
    the files written before trainer_state.json (global_step*/, rng states) still tell the
    saves' order."""
    root = tmp_path / "vol"
    run = root / "out"
    for step in (3000, 4000, 5000):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD + step)
    hf_deepspeed_checkpoint(run, 3500, world=2, mtime=OLD + 20_000)  # the resumed job's save
    for i, step in enumerate((3000, 3500, 4000, 5000)):  # sed -i, in the shell's order
        ts = run / f"checkpoint-{step}" / "trainer_state.json"
        fixed = ts.parent / ".sedXYZ"
        fixed.write_text(ts.read_text().replace(str(run), "/vol/archive/out"))
        os.replace(fixed, ts)
        os.utime(ts, (OLD + 30_000 + i, OLD + 30_000 + i))
        os.utime(ts.parent, (OLD + 30_000 + i, OLD + 30_000 + i))
    cfg = config(tmp_path, root, keep_last=2, keep_best=0)
    prune(cfg)
    assert (run / "checkpoint-3500").is_dir(), "the resumed job's newest save was deleted"
