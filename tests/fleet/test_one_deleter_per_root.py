"""One deleter per root: a prune with another state_dir waits for the daemon leading the root (exit 75),
with or without the root's lock file."""

from __future__ import annotations

import time

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from tests.support.common import run_ckptd
from tests.support.rtkit import config, demo_config

OLD = time.time() - 86400  # a day ago: every quiet period is over


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


# --- Two deleters on one root, when <root>/.ckptd cannot be a directory -------------------------------


def test_a_prune_with_another_state_dir_does_not_delete_beside_a_daemon_without_a_root_lock(tmp_path):
    from tests.support.daemonproc import DaemonProc

    cfg, root = demo_config(tmp_path)
    (root / ".ckptd").write_text("x\n")
    daemon_cfg = tmp_path / "daemon.toml"
    daemon_cfg.write_text(cfg.read_text().replace("quiet_period = \"0s\"", "quiet_period = \"1h\"")
                          .replace(str(tmp_path / "demo" / "state"), str(tmp_path / "state-a")))
    daemon_cfg.write_text(daemon_cfg.read_text().replace("[daemon]\n", "[daemon]\nleadership = 'local'\n", 1))
    prune_cfg = tmp_path / "prune.toml"
    prune_cfg.write_text(cfg.read_text().replace(str(tmp_path / "demo" / "state"), str(tmp_path / "state-b"))
                         .replace("[daemon]\n", "[daemon]\nleadership = 'local'\n", 1))
    # Where <root>/.ckptd cannot be a directory, the root's own lock cannot be taken: neither the
    # daemon nor the prune deletes there (the daemon stands by, the prune exits 75), each saying why.
    unavailable = f"cannot take {root / '.ckptd' / 'local.lock'} (Not a directory): deleting nothing in {root}"
    with DaemonProc("-c", daemon_cfg) as d:
        d.wait_message(f"{root}: standby, observing only: {unavailable}")
        proc = run_ckptd("prune", "-c", prune_cfg)
        d.stop()
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert unavailable in proc.stderr, proc.stderr
    assert all((root / "roberta-mlm" / f"checkpoint-{s}").is_dir() for s in (500, 1000, 1500, 2000))
