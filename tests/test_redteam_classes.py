"""The other members of the red team's classes (tests/test_redteam.py): resume pointers spelled
as paths, pins and run rules spelled as paths, a trash directory that is another filesystem,
empty path arguments, and files ckptd reads that are not regular files.

Hand-made look-alikes (demo.py's DeepSpeed files, Megatron's tracker): the states here are
spellings and file types no framework writes itself; real processes where the CLI decides.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ckptd import dsmeta, evidence, layouts, mounts, slim, volread
from ckptd.config import Retention, Root, parse_config, path_matches
from ckptd.demo import age, hf_deepspeed_checkpoint, write_zip
from ckptd.errors import ConfigError
from ckptd.evidence import Entry, resume_pointers
from ckptd.frameworks import hf, megatron, orbax, torchtitan
from ckptd.frameworks.base import read_pointer
from ckptd.journal import Journal
from ckptd.layouts import TRASH_DIR
from ckptd.planner import Scanner, decide
from ckptd.policy import Action
from ckptd.reaper import Outcome, Reaper
from tests.support.common import run_ckptd

OLD = time.time() - 86400
NOW = time.time()


def bare_deepspeed_run(run: Path, steps: tuple[int, ...]) -> None:
    """global_step<N>/ directly in the run (save_checkpoint(run_dir)), from demo.py's look-alikes."""
    for i, step in enumerate(steps):
        hf_deepspeed_checkpoint(run, step, world=2, mtime=OLD + i)
        os.rename(run / f"checkpoint-{step}" / f"global_step{step}", run / f"global_step{step}")
        shutil.rmtree(run / f"checkpoint-{step}")


def config_file(tmp_path: Path, root: Path, body: str = "", retention: str = "keep_last = 1\nkeep_best = 0") -> Path:
    path = tmp_path / "ckptd.toml"
    path.write_text(
        f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\nquiet_period = '0s'\nallow_short_quiet_period = true\n"
        f"world_size = 2\n{body}\n[roots.retention]\n{retention}\n"
    )
    return path


# --- 1. resume pointers, read as the frameworks read them ----------------------------------------


@pytest.mark.parametrize(
    "text, named",
    [
        ("global_step10", {"global_step10"}),
        ("global_step10/", {"global_step10"}),
        ("./global_step10", {"global_step10"}),
        ("global_step10//", {"global_step10"}),
        ("  global_step10\t\n", {"global_step10"}),
        ("{run}/global_step10", {"global_step10"}),  # absolute, as a user pastes it
        ("{run}/global_step10/", {"global_step10"}),
        ("../run/global_step10", {"global_step10"}),
        ("checkpoint-10/global_step10", {"checkpoint-10"}),  # below a child: the child is what loads
        ("../other/global_step10", set()),
        ("", set()),
        (".", set()),
    ],
)
def test_deepspeed_latest_names_what_deepspeed_loads(tmp_path, text, named):
    """DeepSpeed reads `latest` with .strip() and loads os.path.join(load_dir, tag)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "latest").write_text(text.format(run=run))
    assert set(resume_pointers(run, ["latest"])) == named


@pytest.mark.parametrize(
    "text, named",
    [
        ("{other}/global_step10", set()),  # a directory of its own elsewhere: DeepSpeed loads that
        ("/elsewhere/global_step10", {"global_step10"}),  # another host's mount path: its last component
        ("/elsewhere/global_step10/", {"global_step10"}),
        ("/elsewhere/global_step99", {"global_step10", "global_step20", "latest"}),  # cannot tell: all
    ],
)
def test_an_absolute_latest_outside_the_run_as_seen_here(tmp_path, text, named):
    """Red team 2: an absolute `latest` as another host mounts the volume. Not seen here, its last
    component names the run's checkpoint of that name; naming none, it cannot be told and keeps
    every checkpoint of the run (as an unreadable one); an existing directory elsewhere names nothing."""
    run = tmp_path / "run"
    for name in ("global_step10", "global_step20"):
        (run / name).mkdir(parents=True)
    (tmp_path / "other" / "global_step10").mkdir(parents=True)
    (run / "latest").write_text(text.format(other=tmp_path / "other"))
    assert set(resume_pointers(run, os.listdir(run))) == named


def test_deepspeed_latest_through_a_symlinked_spelling_of_the_run(tmp_path):
    """The volume reached as /data (a symlink) while `latest` holds the path under the real mount."""
    real = tmp_path / "mnt" / "run"
    real.mkdir(parents=True)
    (tmp_path / "data").symlink_to(tmp_path / "mnt")
    (real / "latest").write_text(f"{real}/global_step10\n")
    assert set(resume_pointers(tmp_path / "data" / "run", ["latest"])) == {"global_step10"}


@pytest.mark.parametrize(
    "text, named",
    [("100", "iter_0000100"), ("0000100\n", "iter_0000100"), (" +100 ", "iter_0000100"),
     ("1_00", "iter_0000100"), ("release", "release"), ("12345678", "iter_12345678")],
)
def test_megatron_tracker_names_what_megatron_loads(tmp_path, text, named):
    """Megatron parses its tracker with int(metastring) (checkpointing.py read_metadata)."""
    (tmp_path / layouts.MEGATRON_TRACKER).write_text(text)
    assert resume_pointers(tmp_path, [layouts.MEGATRON_TRACKER]) == {named: layouts.MEGATRON_TRACKER}


@pytest.mark.parametrize("text", ["²", "iter_0000100", "-"])
def test_a_megatron_tracker_megatron_refuses_names_nothing_and_breaks_nothing(tmp_path, text):
    """'²'.isdigit() is True and int('²') raises: the check says UNKNOWN instead of crashing."""
    run = tmp_path / "run"
    (run / "iter_0000100").mkdir(parents=True)
    write_zip(run / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt", 64)
    (run / layouts.MEGATRON_TRACKER).write_text(text)
    assert resume_pointers(run, os.listdir(run)) == {}
    cand = layouts.Candidate("iter_0000100", 100, "megatron", True)
    check = megatron._megatron_tracker(evidence.RunContext(run, frozenset(os.listdir(run))), cand)
    assert check.verdict is evidence.UNKNOWN


@pytest.mark.parametrize("kind", ["fifo", "too long", "directory"])
def test_an_unreadable_latest_keeps_every_checkpoint_of_its_run(tmp_path, kind):
    """`latest` there but unreadable may name any checkpoint: none is deleted, and each says why."""
    root = tmp_path / "vol"
    run = root / "run"
    bare_deepspeed_run(run, (10, 20, 30))
    if kind == "fifo":
        os.mkfifo(run / "latest")
    elif kind == "too long":
        (run / "latest").write_text(" " * 5000 + "global_step10\n")
    else:
        (run / "latest").mkdir()
    age(run / "latest", OLD)
    proc = run_ckptd("prune", "-c", config_file(tmp_path, root), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in run.glob("global_step*")) == ["global_step10", "global_step20", "global_step30"]
    plan = run_ckptd("plan", "-c", config_file(tmp_path, root), timeout=60)
    assert "DeepSpeed's latest (unreadable" in plan.stdout, plan.stdout


@pytest.mark.parametrize("spelling", ["./global_step10", "global_step10/", "{run}/global_step10"])
def test_the_reaper_rereads_latest_with_the_same_spellings(tmp_path, spelling):
    """Rolled back after the plan, spelled as a path: the re-check before the rename refuses."""
    root = tmp_path / "vol"
    run = root / "run"
    bare_deepspeed_run(run, (10, 20, 30))
    scanner = Scanner(Root(path=root, world_size=2, retention=Retention(keep_last=1, keep_best=0)))
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    assert sorted(d.checkpoint.step for d in plan.decisions if d.action is Action.DELETE) == [10, 20]
    (run / "latest").write_text(spelling.format(run=run) + "\n")
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    results = {r.decision.checkpoint.step: r for r in reaper.execute(plan.decisions)}
    assert (results[10].outcome, results[10].detail) == (
        Outcome.REFUSED, "named by DeepSpeed's latest: the framework resumes from it")
    assert (run / "global_step10").is_dir()


# --- 2. pins and run rules spelled as paths ----------------------------------------------------


@pytest.mark.parametrize(
    "pin, stored",
    [
        ("run/checkpoint-1/", "run/checkpoint-1"),
        ("./run/checkpoint-1", "run/checkpoint-1"),
        ("run//checkpoint-1", "run/checkpoint-1"),
        ("{root}/run/checkpoint-1", "run/checkpoint-1"),
        ("{root}/run/checkpoint-1/", "run/checkpoint-1"),
        ("{real}/run/checkpoint-1", "run/checkpoint-1"),  # the root's resolved spelling
        ("run/*/", "run/*"),
    ],
)
def test_a_pin_is_kept_as_the_path_it_names(tmp_path, pin, stored):
    (tmp_path / "mnt").mkdir()
    (tmp_path / "data").symlink_to(tmp_path / "mnt")
    root = tmp_path / "data"
    cfg = parse_config({"roots": [{"path": str(root), "retention": {
        "pins": [pin.format(root=root, real=tmp_path / "mnt")]}}]})
    assert cfg.roots[0].retention.pins == (stored,)


@pytest.mark.parametrize("pin", ["/elsewhere/run/checkpoint-1", "{root}-other/run/checkpoint-1", "../x", "", "."])
def test_a_pin_that_can_never_match_is_refused(tmp_path, pin):
    root = tmp_path / "vol"
    with pytest.raises(ConfigError) as exc:
        parse_config({"roots": [{"path": str(root), "retention": {"pins": [pin.format(root=root)]}}]})
    assert "pins" in str(exc.value)


def test_a_pin_outside_the_root_is_refused_at_load_by_every_command(tmp_path):
    root = tmp_path / "vol"
    hf_deepspeed_checkpoint(root / "run", 1, world=2, mtime=OLD)
    cfg = config_file(tmp_path, root, retention=f"keep_last = 1\npins = ['{tmp_path}/elsewhere/checkpoint-1']")
    for command in ("check-config", "plan", "prune"):
        proc = run_ckptd(command, "-c", cfg)
        assert proc.returncode == 78, (command, proc.stderr)
        assert "roots[0]" in proc.stderr and "retention.pins[0]" in proc.stderr, proc.stderr


@pytest.mark.parametrize("where", ["root", "run rule"])
def test_a_pin_naming_a_path_with_brackets_pins_it_literally(tmp_path, where):
    root = tmp_path / "vol"
    for step in (1, 2, 3):
        hf_deepspeed_checkpoint(root / "exp[a]", step, world=2, mtime=OLD + step)
    pins = "pins = ['exp[a]/checkpoint-1/']"
    if where == "root":
        cfg = config_file(tmp_path, root, retention=f"keep_last = 1\nkeep_best = 0\n{pins}")
    else:
        cfg = config_file(tmp_path, root, retention="keep_last = 1\nkeep_best = 0\n"
                          f"[[roots.runs]]\nmatch = 'exp[a]/'\n{pins}")
    proc = run_ckptd("prune", "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (root / "exp[a]").iterdir()) == ["checkpoint-1", "checkpoint-3"]


@pytest.mark.parametrize("match", ["team/run/", "./team/run", "{root}/team/run", "team/r[u]n", "team/*"])
def test_a_run_rule_spelled_as_a_path_applies_to_its_run(tmp_path, match):
    """A rule that silently missed its run left it to the root's keep_last=1."""
    root = tmp_path / "vol"
    rule = Root.model_validate({"path": str(root), "runs": [{"match": match.format(root=root), "keep_last": 3}]})
    assert rule.retention_for("team/run")[0].keep_last == 3
    assert rule.retention_for("team/other")[0].keep_last == (3 if match == "team/*" else Retention().keep_last)


def test_path_matches_literally_or_as_a_glob():
    assert path_matches("exp[a]/checkpoint-1", "exp[a]/checkpoint-1")
    assert path_matches("expa/checkpoint-1", "exp[a]/checkpoint-1")
    assert not path_matches("exp[a]/checkpoint-10", "exp[a]/checkpoint-1")


def test_pins_and_run_rules_that_match_nothing_are_warnings(tmp_path):
    root = tmp_path / "vol"
    for step in (1, 2):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=OLD + step)
    cfg = config_file(tmp_path, root, retention="keep_last = 1\nkeep_best = 0\npins = ['run/checkpoint-l', 'run/*']\n"
                      "[[roots.runs]]\nmatch = 'rnu'\nkeep_last = 2")
    plan = run_ckptd("plan", "-c", cfg)
    assert plan.returncode == 0, plan.stderr
    assert "retention.pins: 'run/checkpoint-l' matches no checkpoint" in plan.stdout, plan.stdout
    assert "'run/*' matches no" not in plan.stdout
    assert "runs[0].match: 'rnu' matches no run" in plan.stdout
    check = run_ckptd("check-config", "-c", cfg)
    assert check.returncode == 0, check.stderr
    assert "retention.pins: 'run/checkpoint-l' matches no checkpoint" in check.stderr, check.stderr
    assert "runs[0].match: 'rnu' matches no run" in check.stderr


# --- 3. the trash directory on another filesystem ------------------------------------------------




def two_checkpoints(root: Path) -> Scanner:
    for step in (1, 2):
        hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=OLD + step)
    return Scanner(Root(path=root, quiet_period=0, retention=Retention(keep_last=1, keep_best=0)))


@pytest.mark.parametrize("how", ["tmpfs", "bind"])
def test_nothing_is_moved_into_a_trash_on_another_filesystem(tmp_path, mount, how):
    root = tmp_path / "vol"
    scanner = two_checkpoints(root)
    (root / TRASH_DIR).mkdir()
    if how == "tmpfs":
        mount("-t", "tmpfs", "tmpfs", root / TRASH_DIR)
    else:
        (tmp_path / "elsewhere").mkdir()
        mount("--bind", tmp_path / "elsewhere", root / TRASH_DIR)
    (root / TRASH_DIR / "keep-me").write_text("not ckptd's\n")
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    results = reaper.execute(plan.decisions)
    assert [(r.outcome, r.decision.checkpoint.name) for r in results] == [(Outcome.FAILED, "checkpoint-1")]
    assert "a mount point" in results[0].detail or "another filesystem" in results[0].detail
    assert reaper.purge() == (0, 0)
    assert sorted(os.listdir(root / "run")) == ["checkpoint-1", "checkpoint-2"]
    assert os.listdir(root / TRASH_DIR) == ["keep-me"]


def test_a_trash_on_another_device_is_refused_where_the_kernel_cannot_tell_a_mount(tmp_path, mount, monkeypatch):
    """Without statx's mount-root bit (kernels before 5.8) and an unreadable mount table, the
    device number alone tells a tmpfs mounted at the trash."""
    root = tmp_path / "vol"
    scanner = two_checkpoints(root)
    (root / TRASH_DIR).mkdir()
    mount("-t", "tmpfs", "tmpfs", root / TRASH_DIR)
    (root / TRASH_DIR / "keep-me").write_text("not ckptd's\n")
    monkeypatch.setattr(mounts, "is_mount_root", lambda *a, **k: None)
    monkeypatch.setattr(mounts, "read_mounts", lambda *a, **k: [])
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    assert reaper.purge() == (0, 0)
    assert os.listdir(root / TRASH_DIR) == ["keep-me"]


def test_a_bind_mount_at_the_trash_is_found_from_the_mount_table_where_statx_cannot_tell(tmp_path, mount,
                                                                                        monkeypatch):
    root = tmp_path / "vol"
    scanner = two_checkpoints(root)
    (root / TRASH_DIR).mkdir()
    (tmp_path / "elsewhere").mkdir()
    mount("--bind", tmp_path / "elsewhere", root / TRASH_DIR)
    (root / TRASH_DIR / "keep-me").write_text("not ckptd's\n")
    monkeypatch.setattr(mounts, "is_mount_root", lambda *a, **k: None)
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    assert reaper.purge() == (0, 0)
    assert os.listdir(tmp_path / "elsewhere") == ["keep-me"]


def test_a_trash_that_is_a_symlink_is_never_purged_nor_filled(tmp_path):
    root = tmp_path / "vol"
    scanner = two_checkpoints(root)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep-me").write_text("not ckptd's\n")
    (root / TRASH_DIR).symlink_to(tmp_path / "elsewhere")
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    results = reaper.execute(decide([(scanner.root, scanner.runs(now=NOW))]).decisions)
    assert [r.outcome for r in results] == [Outcome.FAILED]
    assert reaper.purge() == (0, 0)
    assert os.listdir(tmp_path / "elsewhere") == ["keep-me"]
    assert sorted(os.listdir(root / "run")) == ["checkpoint-1", "checkpoint-2"]


def test_slimming_refuses_a_trash_on_another_filesystem(tmp_path, mount):
    """A slim moves optimizer shards into the trash too: the same refusal, nothing moved."""
    root = tmp_path / "vol"
    for step in (1, 2, 3):
        ck = hf_deepspeed_checkpoint(root / "run", step, world=2, mtime=OLD + step)
        (ck / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")  # weights: no consolidation
        age(ck, OLD + step)
    (root / TRASH_DIR).mkdir()
    mount("-t", "tmpfs", "tmpfs", root / TRASH_DIR)
    scanner = Scanner(Root(path=root, quiet_period=0, retention=Retention(keep_last=3, keep_best=0,
                                                                          keep_full_last=1)))
    plan = decide([(scanner.root, scanner.runs(now=NOW))])
    assert [d.checkpoint.step for d in plan.decisions if d.action is Action.SLIM] == [1, 2]
    before = sorted(p.name for p in (root / "run" / "checkpoint-1" / "global_step1").iterdir())
    reaper = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False, clock=lambda: NOW)
    results = reaper.execute(plan.decisions)
    assert {r.outcome for r in results} <= {Outcome.FAILED, Outcome.REFUSED}, [r.line() for r in results]
    assert sorted(p.name for p in (root / "run" / "checkpoint-1" / "global_step1").iterdir()) == before
    assert not (root / "run" / "checkpoint-1" / slim.MARKER).exists()


# --- 4. empty path arguments -------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["prune", ""], ["plan", ""], ["run", ""], ["verify", ""], ["latest", ""], ["demo", ""],
     ["plan", "{work}", ""], ["prune", "-c", ""], ["plan", "-c", ""], ["check-config", "-c", ""],
     ["latest", "-c", "", "{work}/someone/exp"]],
)
def test_an_empty_path_argument_is_refused_by_every_command(tmp_path, argv):
    work = tmp_path / "home"
    for step in (1, 2, 3, 4):
        hf_deepspeed_checkpoint(work / "someone" / "exp", step, world=2, mtime=OLD + step)
    args = [a.format(work=work) for a in argv]
    proc = run_ckptd(*args, env={"XDG_STATE_HOME": str(tmp_path / "state")}, cwd=work, timeout=60)
    assert proc.returncode == 64, proc.stdout + proc.stderr
    assert "empty" in proc.stderr
    assert sorted(os.listdir(work / "someone" / "exp")) == [f"checkpoint-{s}" for s in (1, 2, 3, 4)]
    assert sorted(os.listdir(work)) == ["someone"]


def test_an_empty_root_path_in_the_config_is_refused(tmp_path):
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = ''\n")
    proc = run_ckptd("prune", "-c", cfg, cwd=tmp_path)
    assert proc.returncode == 78, proc.stderr
    assert "roots[0].path" in proc.stderr


# --- 5. files ckptd reads that are not regular files -------------------------------------------


def never_blocks(fn, fifo: Path):
    """fn() in a thread; a reader stuck opening the FIFO is let go (a writer opens it) and fails."""
    out: dict[str, object] = {}

    def call() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # any outcome but blocking is fine here
            out["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the blocked open returns; the read sees EOF
        os.close(fd)
        t.join(5)
        pytest.fail(f"blocked on the FIFO {fifo}")
    return out


def as_file(size: int = 4096) -> Entry:
    """What the walk saw a moment earlier: a regular file (swapped for a FIFO since)."""
    return Entry("x", "f", size, 0)


READERS = {
    "slim marker": (slim.MARKER, lambda d, f: evidence.read_slim_marker(d, {slim.MARKER: as_file()})),
    "trainer_state.json": (hf.TRAINER_STATE,
                           lambda d, f: hf._trainer_state(d, {hf.TRAINER_STATE: as_file()})),
    "torchtitan index": (torchtitan.HF_INDEX,
                         lambda d, f: torchtitan._torchtitan(d, {torchtitan.HF_INDEX: as_file()})),
    "megatron-core metadata.json": ("metadata.json",
                                    lambda d, f: megatron._megatron_core(d, {"metadata.json": as_file()}, "")),
    "orbax metadata": (orbax.METADATA, lambda d, f: orbax._orbax(
        layouts.Candidate("1", 1, "orbax", True), d, {orbax.METADATA: as_file()})),
    "orbax metrics": (orbax.METRICS_FILE, lambda d, f: orbax.from_orbax(d)),
    "torch zip": ("model.pt", lambda d, f: evidence.file_problem(f, as_file())),
    "safetensors": ("model.safetensors", lambda d, f: evidence.file_problem(f, as_file())),
    "nemo tar": ("model.nemo", lambda d, f: evidence.file_problem(f, as_file())),
    "model states": ("mp_rank_00_model_states.pt", lambda d, f: dsmeta.read_world_sizes(f)),
    "model states (zip)": ("mp_rank_00_model_states.pt", lambda d, f: dsmeta.read_plain_data(f)),
    "deepspeed latest": ("latest", lambda d, f: read_pointer(f)),
    "megatron tracker": (megatron.TRACKER, lambda d, f: read_pointer(f)),
}


@pytest.mark.parametrize("what", sorted(READERS))
def test_a_fifo_swapped_in_where_ckptd_reads_is_refused_without_blocking(tmp_path, what):
    """Every reader of the volume's files goes through volread: a FIFO is unreadable at once."""
    rel, read = READERS[what]
    fifo = tmp_path / rel
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    out = never_blocks(lambda: read(tmp_path, fifo), fifo)
    error = out.get("error")
    if error is not None:  # refused: as unreadable, never as "read, and empty"
        assert isinstance(error, (OSError, dsmeta.MetadataUnavailable)), repr(error)
        assert "FIFO" in str(error) or isinstance(error, dsmeta.MetadataUnavailable), repr(error)
    else:  # a verdict of its own: a problem, a check not passed, or why it cannot be read
        value = out["value"]
        if isinstance(value, tuple):
            value = value[0] if isinstance(value[0], evidence.Check) else value[1]
        if isinstance(value, evidence.Check):
            assert value.verdict is not evidence.PASSED, value
        else:
            assert isinstance(value, str) and value, value


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory", "symlink"])
def test_volread_opens_regular_files_only(tmp_path, kind):
    path = tmp_path / "x"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    elif kind == "directory":
        path.mkdir()
    else:
        (tmp_path / "target").write_text("x")
        path.symlink_to(tmp_path / "target")
    out = never_blocks(lambda: volread.read_bytes(path, 10), path)
    assert isinstance(out.get("error"), OSError), out
    if kind == "symlink":
        assert volread.read_bytes(path, 10, follow_symlinks=True) == b"x"


@pytest.mark.parametrize("where", ["run/latest", "run2/checkpoint-5/trainer_state.json",
                                   "run2/checkpoint-5/global_step5/mp_rank_00_model_states.pt"])
def test_a_fifo_in_a_run_neither_hangs_prune_nor_deletes_what_it_could_protect(tmp_path, where):
    root = tmp_path / "vol"
    bare_deepspeed_run(root / "run", (10, 20))
    for step in (5, 6):
        hf_deepspeed_checkpoint(root / "run2", step, world=2, mtime=OLD + step)
    os.unlink(root / where) if (root / where).exists() else None
    os.mkfifo(root / where)
    age(root, OLD)
    before = {d: sorted(os.listdir(root / d)) for d in ("run", "run2")}
    cfg = config_file(tmp_path, root)
    try:
        proc = run_ckptd("prune", "-c", cfg, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ckptd prune hung on a FIFO at {where}")
    assert proc.returncode == 0, proc.stderr
    if where == "run/latest":  # may name either: both kept
        assert sorted(os.listdir(root / "run")) == before["run"]
    else:  # a FIFO is not the file it is named as: checkpoint-5 is not complete, and kept
        assert sorted(os.listdir(root / "run2")) == before["run2"]
        plan = run_ckptd("plan", "-c", cfg, timeout=30)
        assert "checkpoint-5" in plan.stdout and "incomplete" in plan.stdout.split("checkpoint-5")[1][:200], (
            plan.stdout)


def test_a_fifo_as_the_volume_lease_record_is_read_as_a_garbled_record(tmp_path):
    """<root>/.ckptd/leader.json is on the volume too: a FIFO there is a record that does not
    parse (as a torn one), read without blocking."""
    from ckptd.lease import RECORD, RecordIO

    (tmp_path / layouts.LEASE_DIR).mkdir()
    os.mkfifo(tmp_path / layouts.LEASE_DIR / RECORD)
    out = never_blocks(lambda: RecordIO(tmp_path).read(), tmp_path / layouts.LEASE_DIR / RECORD)
    seen = out["value"]
    assert seen.raw == b"" and seen.record is None, seen
