"""6. Planning: the retention plan for 10k checkpoints, in one run and across 1k runs.

Pure: the checkpoints are built in memory (as a scan would leave them, every
check passed, a trainer state with an eval_loss for every step) and
`planner.decide` is timed with a fake disk, so only the policy is measured.
The retention sets every rule at once: keep_last, keep_best by eval_loss,
keep_within, max_size and min_free.

Every checkpoint shares one trainer-state history (the newest's, which holds
every step and is the one ckptd consults first); on disk each checkpoint's
file holds the history up to its own step.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

from bench.context import Context
from bench.measure import fmt_time, median
from bench.report import Row, Section
from ckptd.config import Retention, Root
from ckptd.decide import planner, policy
from ckptd.model import Action, Check, Checkpoint, Run, TrainerState, Verdict

NAME = "6. planning"
TARGET_S = 0.050
ROOT = Path("/bench/root")
HOUR = 3600.0
CHECKS = (
    Check("quiet", Verdict.PASSED, "unchanged for 1h (quiet_period=1m)"),
    Check("trainer_state.json", Verdict.PASSED, "parsed"),
    Check("deepspeed shards (global_step1)", Verdict.PASSED, "33/33 files present"),
    Check("rng states", Verdict.PASSED, "32/32 ranks"),
    Check("file integrity", Verdict.PASSED, "68 torch/safetensors files intact"),
)
RETENTION = Retention(
    keep_last=2,
    keep_best=1,
    metric="eval_loss",
    mode="min",
    keep_within="6h",
    max_size="2TiB",
    min_free="10%",
)


def make_runs(runs: int, per_run: int, *, now: float = 2e9) -> list[Run]:
    out = []
    for r in range(runs):
        steps = [(i + 1) * 500 for i in range(per_run)]
        history = {s: {"eval_loss": 2.0 / (1 + i) + 0.01 * ((i * 7 + r) % 5)} for i, s in enumerate(steps)}
        state = TrainerState(
            global_step=steps[-1], best_model_checkpoint=None, best_metric=None, history=history
        )
        rel = f"team-{r % 4}/run-{r}"
        ckpts = tuple(
            Checkpoint(
                root=ROOT,
                run=rel,
                name=f"checkpoint-{s}",
                step=s,
                layout="hf",
                checks=CHECKS,
                size_bytes=16 << 30,
                newest_mtime=now - (per_run - i) * HOUR,
                fingerprint=f"{r:08x}{i:08x}",
                trainer_state=state,
            )
            for i, s in enumerate(steps)
        )
        out.append(Run(ROOT, rel, ckpts))
    return out


def _time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        gc.collect()  # start each repetition with the same heap: no collection owed by the last one
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def run(ctx: Context) -> tuple[list[Row], Section]:
    reps = 3 if ctx.quick else 11
    root = Root(path=ROOT, retention=RETENTION)
    space = lambda p: planner.DiskSpace(free=50 << 40, total=100 << 40)  # noqa: E731
    device = lambda p: 1  # noqa: E731
    rows: list[Row] = []
    section = Section(
        NAME,
        f"`planner.decide` on in-memory checkpoints (all complete), fake disk; median of {reps}. "
        f"Retention: {RETENTION.describe()}, max_size=2TiB, min_free=10%.",
    )
    for runs, per_run in ((1, 10_000), (1_000, 10)):
        ctx.log(f"planning {runs} × {per_run} checkpoints")
        data = make_runs(runs, per_run)
        t = _time(lambda data=data: planner.decide([(root, data)], space=space, device=device), reps)
        t_run = _time(lambda data=data: [policy.decide_run(r, RETENTION) for r in data], reps)
        one = data[0].checkpoints[0]
        n = runs * per_run
        t_dec = _time(
            lambda one=one, n=n: [policy.Decision(one, Action.KEEP, ("kept",)) for _ in range(n)], reps
        )
        plan = planner.decide([(root, data)], space=space, device=device)
        kept = sum(1 for d in plan.decisions if d.action == "keep")
        note = ""
        if t > TARGET_S:
            note = (
                "Python's cost per checkpoint: each rule's loop, a frozen `Decision` per checkpoint (and "
                "another per deletion a budget makes), and the budgets' sums over every decision. "
                "Re-deciding only the runs that changed since the last plan would close it."
            )
        rows.append(
            Row(
                NAME,
                f"{runs:,} run{'s' if runs > 1 else ''} × {per_run:,} checkpoints: `planner.decide`",
                fmt_time(t),
                target="≤ 50 ms",
                met=t <= TARGET_S,
                note=note,
            )
        )
        section.details.append(
            f"{runs:,} × {per_run:,}: decide {fmt_time(t)} (per-run policy {fmt_time(t_run)}; "
            f"building {runs * per_run:,} `Decision`s alone {fmt_time(t_dec)}); "
            f"{kept:,} kept, {len(plan.decisions) - kept:,} deleted."
        )
    return rows, section
