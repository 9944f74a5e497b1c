"""Pins and run rules as users spell them: a path with a trailing slash, `./`, the root's absolute path
(through a symlink or a bind mount), brackets, a file below a checkpoint's top. Each pins what it names
or is refused at load; one that matches nothing is a warning."""

from __future__ import annotations

import time

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.config import Retention, Root, parse_config, path_matches
from ckptd.errors import ConfigError
from tests.support.common import run_ckptd
from tests.support.rtkit import config, config_file, demo_config, prune

OLD = time.time() - 86400  # a day ago: every quiet period is over


# --- Pins spelled as a user writes paths -------------------------------------------------------


@pytest.mark.parametrize("spelling", ["trailing slash", "dot slash", "absolute", "brackets in the run's name"])
def test_a_pin_spelled_as_a_path_pins_or_is_refused(tmp_path, spelling):
    """`pins` are fnmatch globs on the path relative to the root. A pin written the way paths are
    written (tab completion's trailing slash, ./, the absolute path, or a run whose name holds
    [brackets], which fnmatch reads as a character class) matches nothing, silently: no warning
    from plan, prune or check-config, and the checkpoint the user pinned is deleted.
    Either it pins, or the config is refused (exit 78) naming the key."""
    root = tmp_path / "vol"
    run = "exp[ablation]" if spelling == "brackets in the run's name" else "run"
    for step in (1, 2, 3):
        hf_deepspeed_checkpoint(root / run, step, world=2, mtime=OLD + step)
    pin = {
        "trailing slash": f"{run}/checkpoint-1/",
        "dot slash": f"./{run}/checkpoint-1",
        "absolute": str(root / run / "checkpoint-1"),
        "brackets in the run's name": f"{run}/checkpoint-1",
    }[spelling]
    cfg = config(tmp_path, root, keep_last=1, keep_best=0, pins=[pin])
    proc = run_ckptd("prune", "-c", cfg)
    assert proc.returncode in (0, 78), proc.stderr
    if proc.returncode == 78:
        assert "pins" in proc.stderr
    assert (root / run / "checkpoint-1").is_dir(), f"pinned as {pin!r}, and deleted"


# --- The configured root reached through a bind mount is a root of its own --------------------


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


# --- pins and run rules spelled as paths -------------------------------------------------------


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


# --- Pins -------------------------------------------------------------------------------------


@pytest.mark.parametrize("below", ["global_step1000", "global_step1000/mp_rank_00_model_states.pt"])
def test_a_pin_inside_a_checkpoint_keeps_the_checkpoint(tmp_path, below):
    cfg, root = demo_config(tmp_path)
    pinned = root / "roberta-mlm" / "checkpoint-1000" / below
    assert pinned.exists()
    cfg.write_text(cfg.read_text().replace(
        "[roots.retention]\n", f"[roots.retention]\npins = ['roberta-mlm/checkpoint-1000/{below}']\n", 1))
    prune(cfg)
    assert pinned.exists()


# --- Near-miss: ckptd's own pin file taken for a file of the save -------------------------------------


def test_a_pin_file_below_the_top_does_not_make_the_newest_incomplete(tmp_path):
    cfg, root = demo_config(tmp_path)
    run = root / "roberta-mlm"
    (run / "checkpoint-2000" / "global_step2000" / ".ckptd-keep").touch()
    proc = run_ckptd("latest", run, "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("checkpoint-2000"), proc.stdout + proc.stderr
