"""Slimming in the daemon, in-process and fast: the consolidation runs on a worker of its own while
the filesystem thread tracks, settles and deletes.

The consolidator is a stand-in that holds until the test releases it (or the daemon stops it), then
writes what the real one writes: what is tested is the daemon's scheduling around it. The real
zero_to_fp32, paused by its own test hook under the real `ckptd run`, is in test_slim_deepspeed.py.
Waits are on the daemon's log records and the stand-in's start, with timeouts; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.config import load_config
from ckptd.daemon import Daemon
from ckptd.judge import slim
from ckptd.removal.consolidation import WORK_DIR
from ckptd.removal.zero_to_fp32 import ConsolidationFailed
from tests.support.daemonproc import write_config
from tests.support.logwatch import logs  # noqa: F401 - the fixture
from tests.support.slimkit import write_consolidated

pytestmark = pytest.mark.asyncio


SAFETY_NET = 45  # a stand-in never holds longer; the daemon's bounded shutdown is raised above it


class Consolidators:
    """Stand-ins for `ckptd.removal.consolidation.Consolidation`: each holds until released or cancelled.

    A daemon that did not stop its consolidation would wait for it at shutdown, then `os._exit`:
    in-process, the test run itself would end, with status 0. So the shutdown bound is raised
    (`SHUTDOWN_TIMEOUT`) and each stand-in gives up after `SAFETY_NET` s on its own, saying so:
    a test then fails on the reason it was stopped for, and the run goes on.
    """

    def __init__(self, monkeypatch, loop: asyncio.AbstractEventLoop):
        import ckptd.daemon.core

        monkeypatch.setattr(ckptd.daemon.core, "SHUTDOWN_TIMEOUT", SAFETY_NET + 15)
        self.started: asyncio.Queue[Held] = asyncio.Queue()
        self.all: list[Held] = []
        self.fail = False
        outer = self

        class Held:
            def __init__(self, save_dir, tag, model_states, out_dir, *, source_fingerprint, timeout):
                self.out_dir, self.tag, self.fp = out_dir, tag, source_fingerprint
                self.go = threading.Event()
                self.cancelled: str | None = None
                self.fail = outer.fail
                outer.all.append(self)

            def cancel(self, why: str = "cancelled") -> None:
                self.cancelled = why
                self.go.set()

            def run(self):
                net = threading.Timer(SAFETY_NET, self.cancel, ("the test's safety net",))
                net.start()
                loop.call_soon_threadsafe(outer.started.put_nowait, self)
                self.go.wait()
                net.cancel()
                net.join()
                if self.cancelled:
                    raise ConsolidationFailed(self.cancelled)
                if self.fail:
                    raise ConsolidationFailed("zero_to_fp32 took longer than 2h")
                return write_consolidated(self.out_dir, self.tag, self.fp)

        import ckptd.removal.consolidation

        monkeypatch.setattr(ckptd.removal.consolidation, "Consolidation", Held)

    async def next(self, timeout: float = 30):
        return await asyncio.wait_for(self.started.get(), timeout)


def volume(tmp_path: Path, steps=(1, 2), **retention) -> tuple[Path, Path]:
    root = tmp_path / "vol"
    for step in steps:
        hf_deepspeed_checkpoint(root / "job", step, world=2)
    rules = "\n".join(f"{k} = {v!r}" for k, v in {"keep_last": 2, "keep_best": 0, "keep_full_last": 1,
                                                   **retention}.items())
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="world_size = 2\nquiet_period = '0.2s'\nallow_short_quiet_period = true\nobserver = 'inotify'\n"
                                  "reconcile_interval = '1s'", retention=rules)
    return root, cfg


async def test_tracking_and_deleting_go_on_while_a_consolidation_runs(tmp_path, monkeypatch, logs):  # noqa: F811
    root, cfg = volume(tmp_path)
    held = Consolidators(monkeypatch, asyncio.get_running_loop())
    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        first = await held.next()  # checkpoint-1: outside keep_full_last=1, no weights of its own
        assert first.tag == "global_step1" and first.out_dir.parent == root / WORK_DIR
        # while it holds: a new checkpoint completes, and the one being consolidated is deleted
        hf_deepspeed_checkpoint(root / "job", 3, world=2)
        await logs.wait("job/checkpoint-3: complete")
        await logs.wait("deleted job/checkpoint-1")
        await logs.wait("stopped consolidating job/checkpoint-1: the plan no longer slims it (delete")
        assert first.cancelled and not (root / "job" / "checkpoint-1").exists()
        # then the next one: checkpoint-2, outside keep_full_last now
        second = await held.next()
        assert second.tag == "global_step2"
        second.go.set()
        await logs.wait("consolidated job/checkpoint-2: consolidated global_step2 into fp32/")
        await logs.wait("slimmed job/checkpoint-2")
    finally:
        daemon.request_stop("test")
        assert await asyncio.wait_for(task, 30) == 0
    ck = root / "job" / "checkpoint-2"
    assert sorted(os.listdir(ck / "fp32")) == [slim.shard_name(1, 1), slim.INDEX]
    assert not list((ck / "global_step2").glob("*optim_states.pt")) and not any((root / WORK_DIR).iterdir())
    assert len(list((root / "job" / "checkpoint-3" / "global_step3").glob("*optim_states.pt"))) == 2
    assert len(held.all) == 2


async def test_a_running_consolidation_shows_in_status(tmp_path, monkeypatch, logs, state_env):  # noqa: F811
    """`ckptd status` (a real one, reading the state file) names the consolidation running, and
    for how long; the state document holds it while it runs, and not after."""
    from tests.support.common import run_ckptd

    root, cfg = volume(tmp_path)
    held = Consolidators(monkeypatch, asyncio.get_running_loop())
    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        first = await held.next()
        job = daemon.state()["consolidation"]
        assert (job["root"], job["checkpoint"], job["from"]) == (str(root), "job/checkpoint-1", "global_step1")
        daemon.state_file.write(force=True)
        status = await asyncio.to_thread(run_ckptd, "status", "-c", cfg, env=state_env)
        assert status.returncode == 0, status.stderr
        assert f"  consolidating job/checkpoint-1 in {root} (fp32 weights from global_step1): running " in status.stdout
        first.go.set()
        await logs.wait("consolidated job/checkpoint-1")
        assert daemon.state()["consolidation"] is None
    finally:
        daemon.request_stop("test")
        assert await asyncio.wait_for(task, 30) == 0


async def test_a_failed_consolidation_is_not_run_again_on_the_same_checkpoint(tmp_path, monkeypatch, logs):  # noqa: F811
    """Minutes of CPU each: a failure is said once and not retried until the checkpoint changes
    (or a reload); another checkpoint's consolidation goes ahead."""
    root, cfg = volume(tmp_path, keep_last=3)
    held = Consolidators(monkeypatch, asyncio.get_running_loop())
    held.fail = True
    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        (await held.next()).go.set()
        await logs.wait("not consolidating job/checkpoint-1: consolidation failed, nothing removed: "
                        "zero_to_fp32 took longer than 2h")
        held.fail = False
        hf_deepspeed_checkpoint(root / "job", 3, world=2)  # retention again: checkpoint-2 is outside now
        await logs.wait("job/checkpoint-3: complete")
        second = await held.next()
        assert second.tag == "global_step2"
        second.go.set()
        await logs.wait("slimmed job/checkpoint-2")
    finally:
        daemon.request_stop("test")
        assert await asyncio.wait_for(task, 30) == 0
    assert [h.tag for h in held.all] == ["global_step1", "global_step2"]
    assert len(logs.messages("not consolidating job/checkpoint-1")) == 1
    assert not (root / "job" / "checkpoint-1" / "fp32").exists() and not any((root / WORK_DIR).iterdir())


async def test_a_stop_stops_the_consolidation_at_once(tmp_path, monkeypatch, logs):  # noqa: F811
    root, cfg = volume(tmp_path)
    held = Consolidators(monkeypatch, asyncio.get_running_loop())
    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        first = await held.next()
    finally:
        daemon.request_stop("test")
        assert await asyncio.wait_for(task, 30) == 0
    assert first.cancelled == "stopped: the daemon is stopping"
    assert logs.messages("stopped") and not logs.messages("shutdown timed out")
    assert [p.name for p in (root / WORK_DIR).iterdir()] == [first.out_dir.name]  # cleared at the next start


async def test_a_reload_that_stops_slimming_stops_the_consolidation(tmp_path, monkeypatch, logs):  # noqa: F811
    root, cfg = volume(tmp_path)
    held = Consolidators(monkeypatch, asyncio.get_running_loop())
    daemon = Daemon(load_config(cfg), config_path=cfg, install_signals=False)
    task = asyncio.create_task(daemon.serve())
    try:
        first = await held.next()
        cfg.write_text(cfg.read_text().replace("keep_full_last = 1", ""))
        await daemon.reload()
        await logs.wait("stopped consolidating job/checkpoint-1: the plan no longer slims it (keep: keep_last=2")
        assert first.cancelled and not (root / "job" / "checkpoint-1" / "fp32").exists()
    finally:
        daemon.request_stop("test")
        assert await asyncio.wait_for(task, 30) == 0
    assert len(held.all) == 1 and not any((root / WORK_DIR).iterdir())
