"""A root reached through a bind mount: seen by identity and by the mount table, overlapping roots refused
through it, and `verify` and `latest` find the configured root from the other mount point."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint
from tests.support.common import run_ckptd
from tests.support.rtkit import actions, config, trainer_run

OLD = time.time() - 86400  # a day ago: every quiet period is over


def test_located_in_sees_a_bind_mount_by_identity_and_by_the_mount_table(tmp_path, mount):
    """The two ways `mounts.located_in` sees a bind mount: walking up to the root's identity
    (works without the mount table: /proc unreadable) and, for a bind of a directory inside the
    root, the mount table (confirmed by identity). A directory elsewhere is in neither."""
    from ckptd.volume.mounts import located_in, read_mounts

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


# --- One answer to "which configured root holds this path" --------------------------------------


@pytest.mark.frameworks
def test_verify_and_latest_find_the_configured_root_through_a_bind_mount(trainer_volume, tmp_path, mount):
    """The configured root /vol (quiet_period 0s, checkpoint-8 pinned), bind-mounted at /mnt, its
    files just written. `plan /mnt` used the root's config, but `verify /mnt/...` ignored it (60 s
    of default quiet: "writing", not pinned), and `ckptd.latest(run, config=Config(...))` returned
    None, which a training script reads as "start from scratch", while `config="cfg.toml"` found
    checkpoint-8. Now all three take the configured root."""
    import ckptd
    from ckptd.config import load_config

    root, _run = trainer_run(trainer_volume, tmp_path)
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
    return actions(proc.stdout)
