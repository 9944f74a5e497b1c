"""In-memory checkpoints and runs for the pure policy tables (test_policy.py, test_keep_total.py,
test_time_buckets.py, test_metrics.py)."""

from __future__ import annotations

from pathlib import Path

from ckptd.model import Check, Checkpoint, Run, TrainerState, Verdict

ROOT = Path("/vol")


COMPLETE = (Check("quiet", Verdict.PASSED, "quiet"),)


INCOMPLETE = (
    Check("quiet", Verdict.PASSED, "quiet"),
    Check("deepspeed shards", Verdict.FAILED, "rank 3 missing"),
)


def ck(
    step: int,
    checks=COMPLETE,
    *,
    size: int = 10,
    pinned: bool = False,
    mtime: float | None = None,
    losses: dict[int, object] | None = None,
    best: int | None = None,
) -> Checkpoint:
    ts = None
    if losses is not None or best is not None:
        history = {s: {"eval_loss": v} for s, v in (losses or {}).items() if s <= step}
        ts = TrainerState(step, f"checkpoint-{best}" if best is not None else None, None, history)
    return Checkpoint(
        ROOT,
        "run",
        f"checkpoint-{step}",
        step,
        "hf",
        checks,
        size_bytes=size,
        newest_mtime=float(step if mtime is None else mtime),
        saved_at=float(step if mtime is None else mtime),
        written_at=float(step if mtime is None else mtime),
        pinned=pinned,
        trainer_state=ts,
    )


def run_of(*ckpts: Checkpoint) -> Run:
    return Run(ROOT, "run", tuple(ckpts))
