"""How the commands print checkpoints and decisions: tables for people, JSON for scripts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckptd.decide.policy import Decision
from ckptd.errors import EX_IOERR, EX_OK
from ckptd.formatting import format_size
from ckptd.judge.attestation import committed_summary
from ckptd.model import Action, Checkpoint
from ckptd.removal.outcome import Outcome


def report_result(result: Any, totals: dict, would: dict[str, list[int]], note: str) -> int:
    """prune's line for one result; the exit status it calls for (EX_IOERR for a failure)."""
    d = result.decision
    totals[result.outcome] += 1
    size = format_size(d.bytes_freed)
    if result.outcome is Outcome.DRY_RUN:
        would[str(d.action)][0] += 1
        would[str(d.action)][1] += d.bytes_freed
        # "would move to .ckptd-trash/ and purge" says nothing "would delete" does not
        how = f" -> {result.detail}" if d.action is Action.SLIM else ""
        print(f"would {d.action} {d.checkpoint.rel} ({size}): {'; '.join(d.reasons)}{how}{note}")
        return EX_OK
    print(
        f"{d.action} {d.checkpoint.rel} ({size}): "
        f"{'; '.join(d.reasons)} -> {result.outcome}: {result.detail}{note}"
    )
    return EX_IOERR if result.outcome is Outcome.FAILED else EX_OK


def checks_json(c: Checkpoint) -> list[dict[str, str]]:
    return [{"name": k.name, "verdict": str(k.verdict), "detail": k.detail} for k in c.checks]


def _checkpoint_fields(c: Checkpoint) -> dict[str, Any]:
    """The fields that name and describe a checkpoint, first in both `verify --json` and `plan --json`."""
    return {
        "root": str(c.root),
        "run": c.run,
        "path": str(c.path),
        "step": c.step,
        "layout": c.layout,
        "state": str(c.state),
        "size_bytes": c.size_bytes,
    }


def checkpoint_json(c: Checkpoint) -> dict[str, Any]:
    return {
        **_checkpoint_fields(c),
        "pinned": c.pinned,
        "slimmed": c.slimmed,
        "checks": checks_json(c),
    }


def decision_json(d: Decision) -> dict[str, Any]:
    c = d.checkpoint
    metric = d.metric if not isinstance(d.metric, float) or d.metric == d.metric else "nan"
    if isinstance(metric, float) and metric in (float("inf"), float("-inf")):
        metric = str(metric)
    return {
        **_checkpoint_fields(c),
        "metric": metric,
        "metric_source": d.metric_source,
        "step_unit": c.unit,
        "action": str(d.action),
        "bytes_freed": d.bytes_freed,
        "protected": d.protected,
        "reasons": list(d.reasons),
        # the training job's commit records, where it wrote them (ckptd.attest)
        **({"committed": said} if (said := committed_summary(c.checks)) else {}),
    }


def columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows aligned in columns; the last column is left ragged (reasons run long)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(f"{v:<{w}}" for v, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows]


def print_table(decisions: Sequence[Decision], *, checks: bool = False) -> None:
    """The plan as a table; with `checks`, each checkpoint's evidence under its row."""
    header = ("RUN", "CHECKPOINT", "STEP", "STATE", "SIZE", "METRIC", "ACTION", "FREES", "REASONS")
    rows = [header]
    for d in decisions:
        c = d.checkpoint
        metric = f"{d.metric:.4g}" if isinstance(d.metric, float) else (d.metric or "-")
        if d.metric_source is not None:  # where it was read: trainer_state, file name, ...
            metric = f"{metric} ({d.metric_source})"
        rows.append(
            (
                c.run,
                c.name,
                c.step_label,
                str(c.state),
                format_size(c.size_bytes),
                str(metric),
                str(d.action),
                format_size(d.bytes_freed) if d.bytes_freed else "-",
                "; ".join((*d.reasons, *filter(None, [committed_summary(c.checks)]))),
            )
        )
    lines = columns(rows)
    print(lines[0])
    for d, line in zip(decisions, lines[1:], strict=True):
        print(line)
        if checks:
            width = max(len(k.name) for k in d.checkpoint.checks)
            for k in d.checkpoint.checks:
                print(f"    {k.verdict:<8} {k.name:<{width}}  {k.detail}")
