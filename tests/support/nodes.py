"""Many ckptd nodes on one volume: their configs, lease records, listings and journals (the fleet tests)."""

from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.discover.layouts import LEASE_DIR
from ckptd.fleet.leaserecord import RECORD
from ckptd.journal import read_journal

D, M = 1.5, 0.5


def node_config(tmp: Path, name: str, root: Path, *, keep_last: int = 1, lease: str = "",
                duration: float = D, margin: float = M) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(
        f"[daemon]\nstate_dir = '{tmp / name}'\nleadership = 'volume'\n"
        f"lease_duration = '{duration}s'\nlease_margin = '{margin}s'\n{lease}\n"
        f"[[roots]]\npath = '{root}'\nquiet_period = '0.2s'\nallow_short_quiet_period = true\nworld_size = 2\npoll_interval = '0.3s'\n"
        f"[roots.retention]\nkeep_last = {keep_last}\nkeep_best = 0\n"
    )
    return path


def lease_record(root: Path) -> dict:
    return json.loads((root / LEASE_DIR / RECORD).read_text())


def trashed(state_dir: Path) -> list[tuple[str, float]]:
    return [(Path(r["path"]).name, r["time"]) for r in read_journal(state_dir) if r["event"] == "trashed"]


def logged_at(line: dict) -> float:
    """A JSON log line's time (cli.JsonFormatter: ISO 8601 with its offset, "Z" for UTC, milliseconds)."""
    return datetime.fromisoformat(line["time"]).timestamp()


def ckpts(root: Path, *steps: int) -> None:
    for step in steps:
        hf_deepspeed_checkpoint(root / "job", step, world=2)


def listing(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if not p.name.startswith("."))


def wait_stopped(pid: int, timeout: float = 30) -> None:
    """Until the kernel says the process is stopped (state T), bounded."""
    tick = threading.Event()  # never set: a timer between looks at /proc
    for _ in range(int(timeout / 0.02)):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return
        tick.wait(0.02)
    raise AssertionError(f"pid {pid} did not stop within {timeout}s")
