"""Red team, third round: a deletion rests on what the disk says now, counted as the disk counts it.

Each test drives the real CLI (`ckptd plan`/`prune` as subprocesses) or the reaper itself on real
files: checkpoints the HF Trainer saved (fwgen), real hard links, real full filesystems. Each failed
on the code it was written against (dc8590d); the test keeps the fix.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ckptd.config import Retention, Root
from ckptd.journal import Journal
from ckptd.planner import Scanner, decide
from ckptd.reaper import Outcome, Reaper
from ckptd.verdicts import Verdicts
from tests.support.common import run_ckptd
from tests.support.fwfixtures import copy_volume
from tests.support.rtkit import config, prune

# --- 1. A file rewritten in place: the cache, and the reaper's last check ---------------------


def _trainer_run(trainer_volume, tmp_path: Path) -> tuple[Path, Path]:
    """The Trainer's run-state: checkpoint-2..8 complete (eval_loss 0.9, 0.6, 0.4, 0.7: the best is
    checkpoint-6, as checkpoint-8's trainer_state.json says), checkpoint-10 killed before its own."""
    root = copy_volume(trainer_volume, tmp_path / "vol")
    return root, root / "run-state"


def _rename_best(ckpt: Path, old: str, new: str) -> None:
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


def _actions(plan_json: str) -> dict[str, str]:
    return {"/".join(c["path"].split("/")[-2:]): c["action"] for c in json.loads(plan_json)["checkpoints"]}


@pytest.mark.frameworks
def test_a_trainer_state_rewritten_in_place_is_read_again_after_a_plan(trainer_volume, tmp_path):
    """After a `plan` (the verdict cache written in state_dir), the newest trainer_state.json is
    fixed in place to name checkpoint-4 its best, size and mtime kept. The cache restored the old
    trainer state (best checkpoint-6) because no directory changed, and `prune` deleted
    checkpoint-4, the best the file names now; without a state_dir the same prune keeps it."""
    root, run = _trainer_run(trainer_volume, tmp_path)
    (tmp_path / "state").mkdir()
    cfg = config(tmp_path, root, keep_last=1, keep_best=1)
    first = run_ckptd("plan", "-c", cfg, "--json")
    assert first.returncode == 0, first.stderr
    before = _actions(first.stdout)
    assert before["run-state/checkpoint-6"] == "keep" and before["run-state/checkpoint-4"] == "delete"
    _rename_best(run / "checkpoint-8", "checkpoint-6", "checkpoint-4")
    again = run_ckptd("plan", "-c", cfg, "--json")
    now = _actions(again.stdout)
    assert now["run-state/checkpoint-4"] == "keep" and now["run-state/checkpoint-6"] == "delete"  # the disk
    prune(cfg)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-10", "checkpoint-4", "checkpoint-8"]


@pytest.mark.frameworks
def test_the_reapers_last_check_decides_again_from_the_files(trainer_volume, tmp_path):
    """The plan is made; then, before the reaper acts, the newest trainer_state.json is rewritten
    in place (mtime kept) to name checkpoint-4 the best. Every file the reaper re-checked (the
    target, the run's anchors) has its old fingerprint, so it deleted checkpoint-4; the decision
    made again from the files as they are now keeps it, and the reaper refuses."""
    root, run = _trainer_run(trainer_volume, tmp_path)
    r = Root(path=root, quiet_period=0, retention=Retention(keep_last=1, keep_best=1))
    scanner = Scanner(r, verdicts=Verdicts())
    plan = decide([(r, scanner.runs(now=time.time()))])
    doomed = {d.checkpoint.rel for d in plan.deletions}
    assert {"run-state/checkpoint-2", "run-state/checkpoint-4"} <= doomed
    _rename_best(run / "checkpoint-8", "checkpoint-6", "checkpoint-4")
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False)
    results = {res.decision.checkpoint.rel: res for res in reaper.execute(plan.decisions)}
    assert results["run-state/checkpoint-2"].outcome is Outcome.TRASHED
    refused = results["run-state/checkpoint-4"]
    assert refused.outcome is Outcome.REFUSED, refused.detail
    assert "trainer's best_model_checkpoint" in refused.detail
    assert (run / "checkpoint-4").is_dir()


# --- 4. Metric direction as the Trainer infers it ------------------------------------------------


@pytest.mark.parametrize(
    ("metric", "mode"),
    [("eval_loss", "min"), ("loss", "min"), ("val_loss", "min"), ("eval_accuracy", "max"), ("accuracy", "max"),
     ("eval_f1", "max"), ("eval_bleu", "max"), ("eval_samples_per_second", "max"), ("eval_wer", "min"),
     ("perplexity", "min"), ("eval_rmse", "min"), ("eval_error", "min")],
)
def test_a_metric_without_mode_goes_the_trainers_way(metric, mode):
    """transformers training_args.py TrainingArguments.__post_init__: greater_is_better unset is
    `not metric_for_best_model.endswith("loss")`; a known lower-is-better name is minimised too."""
    from ckptd.config import inferred_mode

    assert inferred_mode(metric) == mode
    assert Retention(metric=metric).direction == mode
    other = "max" if mode == "min" else "min"
    assert Retention(metric=metric, mode=other).direction == other  # mode set explicitly wins


@pytest.mark.frameworks
def test_keep_best_by_a_metric_not_ending_in_loss_keeps_the_highest(trainer_volume, tmp_path):
    """`metric = "eval_samples_per_second"` (the Trainer logs it with every evaluation), no `mode`:
    ckptd minimised every metric, so it kept the slowest evaluation and deleted the best by the
    Trainer's own reckoning. Now: the highest is kept, and plan and check-config say 'max' was
    inferred; `mode = "min"` still minimises."""
    root, run = _trainer_run(trainer_volume, tmp_path)
    history = json.loads((run / "checkpoint-8" / "trainer_state.json").read_text())["log_history"]
    speed = {e["step"]: e["eval_samples_per_second"] for e in history if "eval_samples_per_second" in e}
    fastest, slowest = max(speed, key=speed.get), min(speed, key=speed.get)
    assert fastest != slowest
    cfg = config(tmp_path, root, keep_last=1, keep_best=1, metric="eval_samples_per_second")
    plan = run_ckptd("plan", "-c", cfg, "--json")
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    kept = {k for k, a in _actions(plan.stdout).items() if a == "keep" and k.startswith("run-state/")}
    assert kept == {f"run-state/checkpoint-{s}" for s in {fastest, 8, 10}}
    assert any("'max' inferred" in n and "eval_samples_per_second" in n for n in doc["notes"])
    checked = run_ckptd("check-config", "-c", cfg)
    assert checked.returncode == 0, checked.stderr
    assert "'max' inferred" in checked.stderr
    explicit = config(tmp_path, root, keep_last=1, keep_best=1, metric="eval_samples_per_second", mode="min")
    plan = run_ckptd("plan", "-c", explicit, "--json")
    kept = {k for k, a in _actions(plan.stdout).items() if a == "keep" and k.startswith("run-state/")}
    assert kept == {f"run-state/checkpoint-{s}" for s in {slowest, 8, 10}}
    assert json.loads(plan.stdout)["notes"] == []


# --- 2. Bytes as the filesystem counts them: hard links, blocks ----------------------------------

MiB = 1024 * 1024


def _linked_run(trainer_volume, root: Path, into: tuple[int, ...]) -> tuple[Path, Path]:
    """The Trainer's run-state under `root`, and one 8 MiB file hard-linked into the checkpoints
    `into` (a dedup pass, `cp -al`, `rsync --link-dest` make such links; a file added after the
    save, which no check reads)."""
    import shutil

    shutil.copytree(Path(trainer_volume["out_dir"]) / "run-state", root / "run-state", symlinks=True)
    run = root / "run-state"
    first = run / f"checkpoint-{into[0]}" / "eval_predictions.npy"
    first.write_bytes(os.urandom(8 * MiB))
    for step in into[1:]:
        os.link(first, run / f"checkpoint-{step}" / "eval_predictions.npy")
    from ckptd.demo import age

    age(root, time.time() - 3600)
    return root, run


def _plan(cfg: Path) -> dict:
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _du(path: Path) -> int:
    """Allocated bytes under `path`, each inode once (what `du` says)."""
    seen, total = set(), 0
    for p in [path, *path.rglob("*")]:
        st = p.lstat()
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


@pytest.mark.frameworks
def test_max_size_counts_a_hard_linked_file_once(trainer_volume, tmp_path):
    """One 8 MiB file linked into all five checkpoints of a run: `du` says ~8.5 MiB, ckptd summed
    42 MiB and `max_size = "20MiB"` deleted the three oldest. Now the run fits: nothing deleted."""
    root, run = _linked_run(trainer_volume, tmp_path / "vol", (2, 4, 6, 8, 10))
    assert _du(run) < 20 * MiB
    cfg = config(tmp_path, root, keep_last=5, keep_best=0, max_size="20MiB")
    plan = _plan(cfg)
    assert plan["totals"]["delete"] == 0
    assert not [w for w in plan["warnings"] if "max_size" in w], plan["warnings"]  # it fits: nothing to say
    out = prune(cfg)
    assert "0 deleted" in out
    assert sorted(p.name for p in run.iterdir()) == [f"checkpoint-{s}" for s in (10, 2, 4, 6, 8)]


@pytest.mark.frameworks
def test_what_is_freed_counts_what_the_disk_frees(trainer_volume, tmp_path):
    """keep_last=1 deletes checkpoint-2, -4 and -6, each of which links the 8 MiB file the kept
    checkpoint-8 links too: deleting them frees their own files, not the 8 MiB each (ckptd said
    24 MiB). plan's bytes_to_free and prune's 'freed' say what the filesystem freed."""
    root, run = _linked_run(trainer_volume, tmp_path / "vol", (2, 4, 6, 8))
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    own = sum(_du(run / f"checkpoint-{s}") - 8 * MiB for s in (2, 4, 6))
    plan = _plan(cfg)
    assert plan["totals"]["delete"] == 3
    assert plan["totals"]["bytes_to_free"] == own
    out = prune(cfg)
    assert "3 deleted" in out
    freed = out.split("3 deleted (", 1)[1].split(" freed", 1)[0]
    assert freed.endswith(("KiB", "B")) and not freed.endswith("MiB"), out
    assert (run / "checkpoint-8" / "eval_predictions.npy").stat().st_nlink == 1


def _small_volume(mount, where: Path, size_mib: int) -> Path:
    where.mkdir()
    mount("-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", where)
    return where


def _fill_to(root: Path, free: int) -> None:
    """A ballast file that leaves `free` bytes free on root's filesystem."""
    st = os.statvfs(root)
    fd = os.open(root / "ballast", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - free)
    finally:
        os.close(fd)


@pytest.mark.frameworks
@pytest.mark.parametrize(("into", "deleted"), [((2, 4, 6, 8), ()), ((2, 4), (2, 4))])
def test_min_free_weighs_what_deleting_frees_hard_links_considered(trainer_volume, tmp_path, mount, into, deleted):
    """A 48 MiB tmpfs with 8 MiB free, min_free = 16 MiB. With the 8 MiB file linked from the
    newest checkpoint too (protected), deleting every unprotected checkpoint frees well under the
    8 MiB needed: ckptd counted 8 MiB for each and deleted checkpoints for nothing; now it deletes
    none and says min_free cannot be met. Linked only from checkpoint-2 and -4, deleting both
    frees it: both go (one alone frees nothing of it)."""
    vol = _small_volume(mount, tmp_path / "vol", 48)
    root, run = _linked_run(trainer_volume, vol, into)
    _fill_to(root, 8 * MiB)
    cfg = config(tmp_path, root, keep_last=5, keep_best=0, min_free="16MiB")
    plan = _plan(cfg)
    doomed = sorted(c["path"].rsplit("-", 1)[1] for c in plan["checkpoints"] if c["action"] == "delete")
    assert doomed == sorted(str(s) for s in deleted)
    if not deleted:
        assert any("min_free=16MiB cannot be met" in w for w in plan["warnings"]), plan["warnings"]
    prune(cfg)
    assert sorted(p.name for p in run.iterdir()) == sorted(
        f"checkpoint-{s}" for s in (2, 4, 6, 8, 10) if s not in deleted
    )
    if deleted:
        assert os.statvfs(root).f_bavail * os.statvfs(root).f_frsize >= 16 * MiB


# --- 3. Deleting on a full disk ------------------------------------------------------------------


def _full_ext4(mount, tmp_path: Path) -> Path:
    """A 64 MiB ext4 loop mount with no blocks reserved for root (`mkfs -m 0`: the tests run as
    root, and root may use the reserve), to be filled by the caller."""
    import shutil
    import subprocess

    if shutil.which("mkfs.ext4") is None:
        pytest.skip("needs mkfs.ext4 for a real full filesystem")
    image = tmp_path / "disk.img"
    with open(image, "wb") as f:
        f.truncate(64 * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", str(image)], check=True, capture_output=True)
    vol = tmp_path / "vol"
    vol.mkdir()
    mount("-o", "loop", image, vol)
    return vol


def _fill(root: Path) -> None:
    """Every block taken: a ballast file of all but 1 MiB (its extent tree takes blocks too), then
    small files until ENOSPC."""
    _fill_to(root, MiB)
    i = 0
    while True:
        try:
            (root / f"ballast-{i}").write_bytes(b"x" * 4096)
        except OSError as exc:
            assert exc.errno == 28  # ENOSPC
            break
        i += 1
    with pytest.raises(OSError) as exc:
        os.mkdir(root / "probe")
    assert exc.value.errno == 28, "the filesystem is not full: mkdir still works"


@pytest.mark.frameworks
def test_prune_deletes_on_a_full_disk_with_no_trash_yet(trainer_volume, tmp_path, mount):
    """A 100 % full volume with no .ckptd-trash/ yet: `prune` could not make it (ENOSPC), deleted
    nothing and exited 74, on exactly the occasion min_free exists for. Now each checkpoint is
    renamed into the root under a hidden name (a rename needs no new block), purged at once, and
    the trash is made once there is room."""
    vol = _full_ext4(mount, tmp_path)
    root, run = _linked_run(trainer_volume, vol, (2,))
    assert not (root / ".ckptd-trash").exists()
    _fill(root)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0, min_free="1MiB")
    out = prune(cfg)
    assert "3 deleted" in out and "0 failed" in out, out
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-10", "checkpoint-8"]
    assert not [n for n in os.listdir(root) if n.startswith(".ckptd-trash.")]
    assert (root / ".ckptd-trash").is_dir()  # made after the purge, while there is room


@pytest.mark.frameworks
def test_a_checkpoint_renamed_aside_on_a_full_disk_is_purged_by_the_next_start(trainer_volume, tmp_path, mount):
    """Crash-safe as the trash: a checkpoint renamed into the root under a hidden name (no room for
    the trash), then no purge (the process killed), is neither a run nor a checkpoint to the next
    `plan`, and the next `prune` purges it as leftover trash."""
    vol = _full_ext4(mount, tmp_path)
    root, _run = _linked_run(trainer_volume, vol, (2,))
    _fill(root)
    r = Root(path=root, quiet_period=0, retention=Retention(keep_last=1, keep_best=0))
    scanner = Scanner(r, verdicts=Verdicts())
    plan = decide([(r, scanner.runs(now=time.time()))])
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False)
    results = reaper.execute(plan.decisions)
    assert sorted(res.outcome for res in results) == [Outcome.TRASHED] * 3, [res.detail for res in results]
    aside = sorted(n for n in os.listdir(root) if n.startswith(".ckptd-trash."))
    assert len(aside) == 3 and not (root / ".ckptd-trash").exists()
    journal = (tmp_path / "state" / "journal.jsonl").read_text()
    assert all(str(root / n) in journal for n in aside)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    listed = _plan(cfg)
    assert sorted(c["path"].rsplit("/", 1)[1] for c in listed["checkpoints"]) == ["checkpoint-10", "checkpoint-8"]
    out = prune(cfg)
    assert "purged 3 leftover trash entries" in out, out
    assert not [n for n in os.listdir(root) if n.startswith(".ckptd-trash.")]


# --- 6. One answer to "which configured root holds this path" -----------------------------------


@pytest.mark.frameworks
def test_verify_and_latest_find_the_configured_root_through_a_bind_mount(trainer_volume, tmp_path, mount):
    """The configured root /vol (quiet_period 0s, checkpoint-8 pinned), bind-mounted at /mnt, its
    files just written. `plan /mnt` used the root's config, but `verify /mnt/...` ignored it (60 s
    of default quiet: "writing", not pinned), and `ckptd.latest(run, config=Config(...))` returned
    None, which a training script reads as "start from scratch", while `config="cfg.toml"` found
    checkpoint-8. Now all three take the configured root."""
    import ckptd
    from ckptd.config import load_config
    from ckptd.demo import age

    root, _run = _trainer_run(trainer_volume, tmp_path)
    age(root, time.time())  # just written: only the configured quiet period lets them count
    other = tmp_path / "mnt"
    other.mkdir()
    mount("--bind", root, other)
    cfg = config(tmp_path, root, keep_last=1, keep_best=0, pins=["run-state/checkpoint-8"])
    verified = run_ckptd("verify", "-c", cfg, "--json", other / "run-state" / "checkpoint-8")
    doc = json.loads(verified.stdout)
    assert (doc["state"], doc["pinned"]) == ("complete", True), verified.stdout + verified.stderr
    assert verified.returncode == 0
    by_file = ckptd.latest(other / "run-state", config=cfg)
    by_config = ckptd.latest(other / "run-state", config=load_config(cfg))
    assert by_file is not None and by_file.name == "checkpoint-8"
    assert by_config == by_file
    plan = _plan_for(cfg, other)
    assert plan["run-state/checkpoint-8"] == "keep"


def _plan_for(cfg: Path, where: Path) -> dict[str, str]:
    proc = run_ckptd("plan", "-c", cfg, "--json", where)
    assert proc.returncode == 0, proc.stderr
    return _actions(proc.stdout)


def test_a_hidden_trash_name_ckptd_did_not_make_is_never_purged(tmp_path):
    """A checkpoint renamed aside on a full disk is `.ckptd-trash.<time>-<random>-<rel>`; the purge
    takes it for ckptd's. A directory at the root's top that merely starts like that (a person's,
    or a spoof) says nothing of where it came from: left alone, whatever it holds."""
    root = tmp_path / "vol"
    theirs = root / ".ckptd-trash.notes"
    theirs.mkdir(parents=True)
    (theirs / "results.csv").write_text("step,loss\n10,0.5\n")
    cfg = config(tmp_path, root, keep_last=1, keep_best=0)
    prune(cfg)
    prune(cfg)
    assert (theirs / "results.csv").read_text() == "step,loss\n10,0.5\n"
