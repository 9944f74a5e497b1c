"""`ckptd demo --live DIR`: the daemon at work on a simulated training job, for about half a minute.

A simulated 8-rank DeepSpeed job (no torch: the files are shaped like the real ones, `demo.py`)
saves a Trainer `checkpoint-N/` into DIR/experiments every SAVE_EVERY seconds; its best checkpoint
is the oldest; one rank is slow, and its `zero_pp_rank_*` shard of each save lands SLOW_LAG
seconds after the save began, after the next save has begun. Meanwhile the real daemon (`ckptd
run --foreground`, a child process, watchdog watching, a quiet period of QUIET_PERIOD allowed for
the demo) applies keep_last=2 + keep_best=1; its decisions are printed as they happen. The
summary sets them beside what the Trainer's own rotation (`save_total_limit=2`, run on rank 0
after each save) would have deleted at the same moments: the checkpoint the slow rank is still
writing.

The slow rank writes through an open directory: if its checkpoint is deleted under it, its write
fails, and the summary says so. The Trainer's rotation is not carried out (it would break the
job): it is computed, as transformers.trainer_utils.rotate_checkpoints does it, at each moment
rank 0 finished a save.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ckptd.cli.demo_volume import deepspeed_files, hf_deepspeed_checkpoint

CONFIG_NAME = "ckptd.toml"
VOLUME_NAME = "experiments"
RUN = "roberta-mlm"
WORLD = 8
SLOW_RANK = 5
SAVES = 6
SAVE_EVERY = 4.0  # seconds between saves
SLOW_LAG = 5.0  # the slow rank's shard is done this long after its save began
QUIET_PERIOD = 2.0
SAVE_TOTAL_LIMIT = 2
STEP = 500
# eval_loss per save: the first is the best (the case in-process rotation keeps by its own rule)
LOSSES = [0.81, 0.97, 0.93, 0.92, 0.90, 0.88]

LIVE_CONFIG = """\
# Written by `ckptd demo --live`. See config.example.toml for every key.
[daemon]
state_dir = "{state}"

[[roots]]
path = "{root}"
# The demo's saves come every {every:g} s; a real job's quiet_period is a minute or more.
quiet_period = "{quiet:g}s"
allow_short_quiet_period = true
poll_interval = "1s"

[roots.retention]
keep_last = 2
keep_best = 1
metric = "eval_loss"
mode = "min"
"""


@dataclass
class Save:
    step: int
    began: float  # seconds since the demo began
    rank0_done: float = 0.0
    slow_done: float | None = None
    slow_failed: str | None = None

    @property
    def name(self) -> str:
        return f"checkpoint-{self.step}"


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.t0


def slow_shard_name() -> str:
    return next(n for n in deepspeed_files(WORLD) if n.startswith(f"zero_pp_rank_{SLOW_RANK}_"))


def _shard_bytes() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"\0" * 1024)  # as demo.write_zip, every rank's shard alike
    return out.getvalue()


class Job:
    """The simulated training job: rank 0's side of each save at once, the slow rank's later."""

    def __init__(self, run: Path, clock: Clock, stop: threading.Event, say):
        self.run, self.clock, self.stop, self.say = run, clock, stop, say
        self.saves: list[Save] = []
        self.losses = {STEP * (i + 1): loss for i, loss in enumerate(LOSSES)}
        self.best = STEP

    def main(self) -> None:
        writers = []
        for i in range(SAVES):
            if self.stop.wait(max(0.0, i * SAVE_EVERY - self.clock())):
                break
            save = Save(STEP * (i + 1), self.clock())
            hf_deepspeed_checkpoint(
                self.run, save.step, world=WORLD, losses=self.losses, best=self.best, skip={slow_shard_name()}
            )
            save.rank0_done = self.clock()
            self.saves.append(save)
            self.say(save.rank0_done, f"job: saved {save.name} (eval_loss {self.losses[save.step]:.2f}); "
                     f"rank {SLOW_RANK} still writing its shard")  # fmt: skip
            w = threading.Thread(target=self._slow_rank, args=(save,), name=f"demo-rank{SLOW_RANK}")
            w.start()
            writers.append(w)
        for w in writers:
            w.join()

    def _slow_rank(self, save: Save) -> None:
        """Open the shard at once, write it slowly, close it SLOW_LAG after the save began."""
        data = _shard_bytes()
        chunks = 4
        step = len(data) // chunks + 1
        path = self.run / save.name / f"global_step{save.step}" / slow_shard_name()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for k in range(chunks):
                    self.stop.wait(max(0.0, save.began + SLOW_LAG * (k + 1) / chunks - self.clock()))
                    os.write(fd, data[k * step : (k + 1) * step])
                    if not (self.run / save.name).is_dir():
                        raise FileNotFoundError(f"{save.name} deleted while rank {SLOW_RANK} wrote into it")
            finally:
                os.close(fd)
        except OSError as exc:
            save.slow_failed = str(exc)
            self.say(self.clock(), f"job: rank {SLOW_RANK} FAILED writing {save.name}: {exc}")
            return
        save.slow_done = self.clock()
        self.say(save.slow_done, f"job: rank {SLOW_RANK} finished its shard of {save.name}")


class DaemonLog:
    """Reads the daemon's JSON log lines, prints what it decided, remembers deletions."""

    def __init__(self, stream: IO[str], clock: Clock, say):
        self.stream, self.clock, self.say = stream, clock, say
        self.deleted: dict[str, float] = {}
        self.ready = threading.Event()
        self.lines: list[str] = []

    def main(self) -> None:
        for raw in self.stream:
            self.lines.append(raw)
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            now, msg = self.clock(), str(line.get("message", ""))
            if msg.startswith("ready: "):
                self.ready.set()
            elif line.get("outcome") == "trashed" or msg.startswith("deleted "):
                name = str(line.get("checkpoint") or msg.split()[1].rsplit("/", 1)[-1])
                self.deleted.setdefault(name, now)
                self.say(now, f"ckptd: {msg}")
            elif line.get("checkpoint") and line.get("state") or line.get("level") in ("WARNING", "ERROR"):
                self.say(now, f"ckptd: {msg}")


def trainer_rotation(saved: list[int], best: int, limit: int) -> list[int]:
    """What transformers.trainer_utils.rotate_checkpoints deletes from `saved` (steps): oldest first,
    never the most recent nor the best, until `limit` are left (or as many as are protected)."""
    ordered = sorted(saved)
    if len(ordered) <= limit:
        return []
    protected = {ordered[-1], best}
    keep = max(limit, len(protected))
    gone: list[int] = []
    for step in ordered:
        if len(ordered) - len(gone) <= keep:
            break
        if step not in protected:
            gone.append(step)
    return gone


def run(base: Path, out=print) -> int:
    """The demo in `base`: returns 0 if ckptd deleted nothing while it was being written."""
    clock = Clock()
    root = base / VOLUME_NAME
    (root / RUN).mkdir(parents=True, exist_ok=True)
    config = base / CONFIG_NAME
    text = LIVE_CONFIG.format(root=root, state=base / "state", quiet=QUIET_PERIOD, every=SAVE_EVERY)
    config.write_text(text)
    lock = threading.Lock()

    def say(t: float, text: str) -> None:
        with lock:
            out(f"{t:5.1f}s  {text}")

    out(
        f"ckptd demo --live: a simulated {WORLD}-rank DeepSpeed job saves {root / RUN}/checkpoint-N "
        f"every {SAVE_EVERY:g} s; rank {SLOW_RANK} writes its shard {SLOW_LAG:g} s late. The daemon: {config}"
    )
    cmd = [sys.executable, "-m", "ckptd", "run", "--foreground", "--log-format", "json", "-c", str(config)]
    daemon = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert daemon.stdout is not None
    log = DaemonLog(daemon.stdout, clock, say)
    reader = threading.Thread(target=log.main, name="demo-daemon-log")
    reader.start()
    stop = threading.Event()
    job = Job(root / RUN, clock, stop, say)
    try:
        if not log.ready.wait(60):
            out("ckptd did not become ready within 60 s:\n" + "".join(log.lines[-20:]))
            return 1
        job.clock = log.clock = clock = Clock()  # the scene's clock starts with the first save
        say(0.0, "ckptd: ready, watching")
        job.main()
        expected = _policy_final_set(job)
        deadline = clock() + 3 * QUIET_PERIOD + 5
        while clock() < deadline and _on_disk(root / RUN) != expected:
            stop.wait(0.2)  # the daemon's last decisions: a quiet period after the last shard
    finally:
        stop.set()
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        reader.join(10)
    return _summary(job, log, _on_disk(root / RUN), out)


def _on_disk(run: Path) -> list[str]:
    names = [p.name for p in run.iterdir() if p.name.startswith("checkpoint-")] if run.is_dir() else []
    return sorted(names, key=lambda n: int(n.rpartition("-")[2]))


def _policy_final_set(job: Job) -> list[str]:
    """keep_last=2 + keep_best=1 once every save is complete: the best and the two newest."""
    steps = [s.step for s in job.saves]
    keep = {job.best, *steps[-2:]}
    return [f"checkpoint-{s}" for s in sorted(keep)]


def _summary(job: Job, log: DaemonLog, final: list[str], out) -> int:
    by_name = {s.name: s for s in job.saves}
    unsafe = [
        name for name, t in log.deleted.items()
        if name in by_name and (by_name[name].slow_done is None or t < by_name[name].slow_done)
    ]  # fmt: skip
    unsafe += [s.name for s in job.saves if s.slow_failed and s.name not in unsafe]
    trainer: list[tuple[str, float, bool]] = []
    saved: list[int] = []
    for s in job.saves:  # rank 0 rotates right after its part of each save
        saved.append(s.step)
        for step in trainer_rotation(saved, job.best, SAVE_TOTAL_LIMIT):
            saved.remove(step)
            victim = by_name[f"checkpoint-{step}"]
            writing = victim.slow_done is None or victim.slow_done > s.rank0_done
            trainer.append((victim.name, s.rank0_done, writing))
    out("")
    out(f"summary: {len(job.saves)} saves; rank {SLOW_RANK} finished each {SLOW_LAG:g} s after it began")
    out("  ckptd, keep_last=2 + keep_best=1 (eval_loss, min):")
    for name, t in sorted(log.deleted.items(), key=lambda kv: kv[1]):
        s = by_name.get(name)
        finished = s is not None and s.slow_done is not None
        done = f"its last shard done at {s.slow_done:.1f}s" if finished else "never finished"
        out(f"    {t:5.1f}s  deleted {name} ({done})")
    which = f" ({', '.join(unsafe)})" if unsafe else ""
    out(f"    deleted while a rank was writing it: {len(unsafe)}{which}")
    out(f"    kept: {' '.join(final)}")
    out(f"  the Trainer's save_total_limit={SAVE_TOTAL_LIMIT} rotation on rank 0, at the same moments:")
    for name, t, writing in trainer:
        note = f"  <- rank {SLOW_RANK} still writing it" if writing else ""
        out(f"    {t:5.1f}s  would delete {name}{note}")
    out(f"    would have deleted while a rank was writing it: {sum(w for _, _, w in trainer)}")
    return 0 if not unsafe and final == _policy_final_set(job) else 1
