"""A standby for a volume lease watches the lease closely and the volume loosely: no polls,
a full scan at each reconcile, and a catch-up scan at takeover before its first deletion.
Real `ckptd run` processes, two "hosts" (their own state_dirs) as in test_multinode.
"""

from __future__ import annotations

from datetime import datetime

from tests.support.daemonproc import DaemonProc
from tests.support.nodes import ckpts, listing, node_config


def at(line: dict) -> float:
    return datetime.fromisoformat(line["time"]).timestamp()


def test_a_standby_does_not_track_the_volume_and_catches_up_before_its_first_deletion(tmp_path):
    root = tmp_path / "vol"
    ckpts(root, 1, 2)
    a = DaemonProc("-c", node_config(tmp_path, "a", root))
    b = None
    try:
        a.wait_message("deleted job/checkpoint-1")
        cfg = node_config(tmp_path, "b", root)
        # As on a network filesystem: polling (inotify does not see other hosts' writes).
        cfg.write_text(cfg.read_text().replace("poll_interval = '0.3s'\n", "poll_interval = '0.3s'\n"
                                               "reconcile_interval = '1h'\nobserver = 'polling'\n"))
        b = DaemonProc("-c", cfg)
        b.wait_message("standby, observing only")
        b.wait_message("job/checkpoint-2: complete")  # its start-up scan
        ckpts(root, 3)
        a.wait_message("deleted job/checkpoint-2")
        mark = b.mark()
        b.wait_message("state written", start=mark)  # b ticked since, and
        assert not [m for m in b.lines if "checkpoint-3" in m.get("message", "")], b.dump()  # never looked
        a.proc.kill()
        a.proc.wait(30)
        ckpts(root, 4)
        [took] = b.wait_message("this ckptd deletes here (volume lease, epoch 2)", timeout=60)
        [seen] = b.wait_message("job/checkpoint-4: complete")
        [deleted] = b.wait_message("deleted job/checkpoint-3")
    finally:
        a.stop()
        if b is not None:
            b.stop()
    assert at(took) <= at(seen) <= at(deleted)
    assert listing(root / "job") == ["checkpoint-4"]
    print(f"takeover to first enforced deletion: {at(deleted) - at(took):.2f}s")
