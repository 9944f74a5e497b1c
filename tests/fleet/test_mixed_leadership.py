"""One lock for every deleter in a root, whatever its leadership: a daemon leading under the
volume lease and a `prune` with `leadership = "local"` (its own state_dir), or the reverse,
exclude each other through `<root>/.ckptd/local.lock`. Real `ckptd run` and `ckptd prune`
processes; before, both deleted in the root.
"""

from __future__ import annotations

from pathlib import Path

from ckptd.discover.layouts import LEASE_DIR
from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc
from tests.support.nodes import ckpts, listing, node_config


def local_config(tmp: Path, name: str, root: Path, *, keep_last: int) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(
        f"[daemon]\nstate_dir = '{tmp / name}'\nleadership = 'local'\n"
        f"[[roots]]\npath = '{root}'\nquiet_period = '0.2s'\nallow_short_quiet_period = true\nworld_size = 2\npoll_interval = '0.3s'\n"
        f"[roots.retention]\nkeep_last = {keep_last}\nkeep_best = 0\n"
    )
    return path


def test_a_local_prune_does_not_delete_while_a_volume_leader_deletes_there(tmp_path):
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    cron = local_config(tmp_path, "cron", root, keep_last=1)
    with DaemonProc("-c", node_config(tmp_path, "a", root, keep_last=5)) as a:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        proc = run_ckptd("prune", "-c", cron)
        assert proc.returncode == 75, proc.stdout + proc.stderr
        assert f"another ckptd is deleting in {root} (holds {root / LEASE_DIR / 'local.lock'})" in proc.stderr
        assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
        # Where it can be seen, the mixed settings are said before anything is tried.
        check = run_ckptd("check-config", "-c", cron)
        assert check.returncode == 0, check.stderr
        assert (f"pid {a.proc.pid} leads {root} under a volume lease (epoch 1) and this ckptd has "
                'leadership = "local"') in check.stdout + check.stderr
    proc = run_ckptd("prune", "-c", cron)  # the leader gone, the lock with it
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert listing(root / "job") == ["checkpoint-3"]


def test_a_volume_prune_does_not_delete_while_a_local_leader_deletes_there(tmp_path):
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    cron = node_config(tmp_path, "cron", root, keep_last=1)
    with DaemonProc("-c", local_config(tmp_path, "a", root, keep_last=5)) as a:
        a.wait_message("this ckptd deletes here (holds")
        proc = run_ckptd("prune", "-c", cron)
        assert proc.returncode == 75, proc.stdout + proc.stderr
        assert f'a ckptd with leadership = "local" deletes here (it holds {root / LEASE_DIR / "local.lock"})' \
            in proc.stderr
        assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    proc = run_ckptd("prune", "-c", cron)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert listing(root / "job") == ["checkpoint-3"]


def test_a_local_daemon_beside_a_volume_leader_stands_by_and_says_why(tmp_path):
    root = tmp_path / "vol"
    ckpts(root, 1, 2, 3)
    with DaemonProc("-c", node_config(tmp_path, "a", root, keep_last=5)) as a:
        a.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        with DaemonProc("-c", local_config(tmp_path, "b", root, keep_last=1)) as b:
            b.wait_message(f"pid {a.proc.pid} leads {root} under a volume lease (epoch 1)")
            b.wait_message(f"standby, observing only: another ckptd is deleting in {root}")
            b.wait_message("decide delete job/checkpoint-1")  # decided; not carried out
            a.wait_message("state written", start=a.mark())
            b.wait_message("state written", start=b.mark())
            # Not even tried: a standby's retention stops before the reaper (whose fence would refuse).
            assert not [m for m in b.lines if "not deleting" in m.get("message", "")], b.dump()
        assert listing(root / "job") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
