"""`ckptd.integrations.deepspeed.wrap` on a real 2-rank ZeRO-2 DeepSpeed job (dsgen.py, bare layout:
`<out>/global_stepN/` is the checkpoint): each rank's record in the tag directory, and the engine
counting the save complete on them inside the quiet period."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from ckptd.config import Root
from ckptd.decide.planner import Scanner
from ckptd.judge import attestation
from ckptd.model import ATTESTED, State
from tests.support import dsgen
from tests.support.common import REPO, run_ckptd
from tests.support.daemonproc import DaemonProc, write_config

pytestmark = pytest.mark.deepspeed


def test_each_rank_records_its_deepspeed_save(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    env = {"DSGEN_ATTEST": "1", "PYTHONPATH": os.pathsep.join([str(REPO),
                                                                 os.environ.get("PYTHONPATH", "")])}
    dsgen.generate(out, world_size=2, stage=2, layout="bare", steps=(10, 20), env=env)
    tag = out / "global_step20"
    recs = {p.name: json.loads(p.read_text()) for p in (tag / ".ckptd").glob("*.json")}
    assert sorted(recs) == ["commit-rank0-of-2.json", "commit-rank1-of-2.json"]
    listed = {n: {f["path"] for f in r["files"]} for n, r in recs.items()}
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in listed["commit-rank1-of-2.json"]
    assert "mp_rank_00_model_states.pt" in listed["commit-rank0-of-2.json"]
    now = max(p.stat().st_mtime for p in tag.rglob("*")) + 1  # inside the quiet period
    [run] = Scanner(Root(path=tmp_path, world_size=2)).runs(now=now)
    c = next(c for c in run.checkpoints if c.name == "global_step20")
    assert c.state is State.COMPLETE, [str(k) for k in c.checks]
    assert any(k.name == ATTESTED for k in c.checks)


def state_reasons(daemon: DaemonProc, name: str, text: str, timeout: float) -> str:
    """Wait until a state file the daemon writes gives checkpoint `name` a reason containing `text`."""
    found: list[str] = []

    def says(line: dict) -> bool:
        message = line.get("message", "")
        if found or not message.startswith("state written to "):
            return bool(found)
        try:
            roots = json.loads(Path(message.removeprefix("state written to ")).read_text())["roots"]
        except (OSError, ValueError, KeyError):
            return False  # replaced since: a later line names the next one
        for reason in (r for root in roots for run in root["runs"] for c in run["checkpoints"]
                       if c["name"] == name for r in c["reasons"]):
            if text in reason:
                found.append(reason)
        return bool(found)

    daemon.wait_for(says, timeout=timeout, start=daemon.mark())
    return found[0]


def test_a_rank_killed_mid_save_leaves_an_abandoned_save_the_daemon_keeps(tmp_path):
    """Rank 1 SIGKILLed inside its third `save_checkpoint`, before its ZeRO shard: no record from it
    (nor from rank 0, whose save ends at DeepSpeed's barrier after rank 1's shard), the leases left.
    The real `ckptd run` with keep_last=1 and a run budget that nothing fits (max_size): the killed save
    is never complete and never deleted, the newest complete one (global_step2) is kept; its leases
    hold it in flight until their heartbeats are old, then it is incomplete and `ckptd verify` says
    the save was abandoned."""
    pytest.importorskip("deepspeed")
    root = tmp_path / "vol"
    run = root / "run"
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="world_size = 2\nquiet_period = '2s'\nallow_short_quiet_period = true\n"
                                  "poll_interval = '1s'",
                       retention="keep_last = 1\nkeep_best = 0\nmax_size = '1KiB'")
    root.mkdir()
    env = {"DSGEN_ATTEST": "1"}
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("ready")
        with dsgen.start(run, world_size=2, stage=2, layout="bare", steps=(1, 2, 3), train_steps_per_save=1,
                         slow_rank=1, slow_seconds=600, env=env) as job:
            held = job.wait_for("slow_rank_waiting", timeout=180)
            os.kill(int(held["pid"]), signal.SIGKILL)  # rank 1, inside its save of global_step3
            job.proc.wait(timeout=120)  # torch.multiprocessing.spawn ends the job when a rank dies
        assert job.proc.returncode != 0
        killed = run / "global_step3"
        assert not (killed / "zero_pp_rank_1_mp_rank_00_optim_states.pt").exists()
        assert sorted(p.name for p in (killed / ".ckptd").iterdir()) == ["lease-rank0-of-2.json",
                                                                         "lease-rank1-of-2.json"]
        daemon.wait_message("deleted run/global_step1", timeout=60)
        # past its quiet period, the killed save's leases (their heartbeats only just stopped) hold it in
        # flight: what the daemon's state file (`ckptd status`) says of it
        held_by = state_reasons(daemon, "global_step3", "save lease failed: rank 0's save", timeout=30)
        assert held_by.startswith("writing, never deleted: "), held_by
        stopped = time.time() - attestation.STALE_AFTER - 60  # the heartbeats stopped that long ago
        mark = daemon.mark()
        for lease in (killed / ".ckptd").glob("lease-*"):
            os.utime(lease, (stopped, stopped))
        daemon.wait_for(lambda r: r.get("checkpoint") == "global_step3" and r.get("state") == "incomplete",
                        timeout=30, start=mark)  # only once its leases are stale: not while they lived
        shown = run_ckptd("verify", "-c", cfg, killed)
        said = daemon.lines[:]
    assert "failed   commit records" in shown.stdout, shown.stdout
    assert "abandoned: rank 0's save stopped at " in shown.stdout and "(and 1 more)" in shown.stdout
    assert not [r for r in said if r.get("checkpoint") == "global_step3" and r.get("state") == "complete"]
    assert not [r for r in said[:mark] if r.get("checkpoint") == "global_step3" and r.get("state") == "incomplete"]
    assert not [r for r in said if r.get("checkpoint") in ("global_step2", "global_step3")
                and str(r.get("message", "")).startswith("deleted ")], daemon.dump()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("global_step")) == ["global_step2",
                                                                                       "global_step3"]
