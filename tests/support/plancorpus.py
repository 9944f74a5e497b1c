"""A varied, deterministic corpus of in-memory runs and roots, and the plans `planner.decide`
makes of them, written out whole (every decision's action, reasons, protection and metric, and
every warning): what `test_plan_equivalence.py` compares against, so that making planning
faster cannot change a decision or a reason unnoticed.

Hand-made checkpoints, as the scan would leave them: planning is pure, and the states here
(a pinned slimmed checkpoint holding a mount, NaN metrics from three sources, rank directories
with different newest steps...) are combinations no framework run would produce in a test's time.

    PYTHONPATH=. python3 -m tests.support.plancorpus          # rewrite tests/data/plan_decisions.json from the code as it is

Regenerate only on a commit whose decisions are known good (it records what the code decides).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from ckptd.config import Root
from ckptd.decide import planner
from ckptd.discover.layouts import PIN_FILE
from ckptd.frameworks.pattern import EVIDENCE, QUIET_ALONE
from ckptd.judge.evidence import ONE_SAVE
from ckptd.model import (
    FILE_NAME,
    ORBAX_METRICS,
    Check,
    Checkpoint,
    Reading,
    Run,
    Slimming,
    TrainerState,
    Verdict,
)

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parent / "data" / "plan_decisions.json"

P, F, U = Verdict.PASSED, Verdict.FAILED, Verdict.UNKNOWN
CHECKS = {
    "complete": (Check("quiet", P, "quiet"), Check("shards", P, "8/8")),
    "writing": (Check("quiet", F, "changed 1s ago"), Check("shards", P, "8/8")),
    "settling": (Check("quiet", U, "settling"),),
    "incomplete": (Check("quiet", P, "quiet"), Check("shards", F, "rank 3 missing")),
    "stalled": (Check("quiet", P, "quiet"), Check("shards", F, "rank 3 missing"), Check("stall", F, "6h")),
    "unknown": (Check("quiet", P, "quiet"), Check("trainer_state.json", U, "unreadable")),
    "quiet alone": (Check("quiet", P, "quiet"), Check(EVIDENCE, P, QUIET_ALONE)),
    "mixed": (Check("quiet", P, "quiet"), Check(ONE_SAVE, F, "two saves")),
}
STATE_WEIGHTS = {
    "complete": 20, "writing": 1, "settling": 1, "incomplete": 1, "stalled": 1, "unknown": 1,
    "quiet alone": 1, "mixed": 1,
}


def _value(rng: random.Random) -> object:
    x = rng.random()
    if x < 0.05:
        return math.nan
    if x < 0.08:
        return math.inf
    if x < 0.11:
        return "oops"
    if x < 0.13:
        return True
    return round(rng.uniform(0.1, 3.0), rng.choice((1, 2, 6)))  # rounded: ties happen


def _slim(rng: random.Random) -> Slimming:
    x = rng.random()
    if x < 0.5:
        return Slimming()
    if x < 0.6:
        return Slimming(slimmed=True, removable=(("global_step1/optim.pt", 7),) if rng.random() < 0.5 else ())
    if x < 0.7:
        return Slimming(removable=(("global_step1/optim.pt", 7),), blocker="no fp32 weights")
    keeps = rng.choice(("", "model.safetensors (bf16)"))
    return Slimming(removable=(("global_step1/optim.pt", 7), ("zero/x", 3)), weights="model.safetensors",
                    keeps=keeps)


def make_run(rng: random.Random, root: Path, rel: str, n: int, *, names: list[str] | None = None) -> Run:
    """One run of `n` checkpoints, every field varied."""
    unit = rng.choice(("step", "step", "step", "epoch", "save"))
    steps = sorted(rng.sample(range(1, 40 * max(n, 1)), n))
    if rng.random() < 0.2 and n > 2:  # steps that go backwards: an old run's later restart
        steps[rng.randrange(n)] = steps[0]
    history: dict[int, dict[str, object]] = {}
    metric_at = rng.choice(("trainer", "own", "both", "none"))
    for s in steps:
        if rng.random() < 0.85:
            history[s] = {"eval_loss": _value(rng), "loss": _value(rng), "eval_acc": _value(rng)}
    ckpts = []
    base = 1e9 + rng.randrange(100) * 60.0
    for i, s in enumerate(steps):
        state = rng.choices(list(STATE_WEIGHTS), weights=list(STATE_WEIGHTS.values()))[0]
        saved = base + i * 600.0 + rng.choice((0.0, 0.0, rng.uniform(-900, 900)))
        written = saved + rng.choice((0.0, 30.0, 30.0, rng.uniform(0, 2000)))
        touched = written + (rng.uniform(0, 5000) if rng.random() < 0.15 else 0.0)
        if rng.random() < 0.1:  # the Trainer's test for unreliable mtimes: all within a second
            saved = written = touched = base + rng.random() * 0.5
        ts = None
        if metric_at in ("trainer", "both") and rng.random() < 0.8:
            best = rng.choice([*steps, None, 999999])
            ts = TrainerState(
                s,
                f"checkpoint-{best}" if best is not None else None,
                rng.choice((None, 0.25, math.nan)),
                {k: v for k, v in history.items() if k <= s and rng.random() < 0.95},
            )
        metrics: tuple[tuple[str, Reading], ...] = ()
        if metric_at in ("own", "both") and rng.random() < 0.8:
            src = rng.choice((FILE_NAME, ORBAX_METRICS))
            v = _value(rng)
            metrics = (("epoch", Reading(float(i), FILE_NAME)), ("eval_loss", Reading(
                v if isinstance(v, str) else float(v), src)))  # type: ignore[arg-type]
        name = names[i] if names is not None else (f"checkpoint-{s}" if rng.random() < 0.95 else f"ckpt[{s}]")
        holds: tuple[str, ...] = ()
        if rng.random() < 0.04:
            holds = rng.choice((("inner/checkpoint-1",), (f"sub/{PIN_FILE}",), tuple(f"r/c-{k}" for k in range(5))))
        ckpts.append(
            Checkpoint(
                root=root,
                run=rel,
                name=name,
                step=s,
                layout=rng.choice(("hf", "deepspeed", "lightning", "orbax")),
                checks=CHECKS[state],
                size_bytes=rng.choice((10, 100, 1000, rng.randrange(1, 5000))),
                newest_mtime=touched,
                fingerprint=f"{rel}/{name}",
                saved_at=saved,
                written_at=written,
                touched_at=touched,
                mounts=("",) if rng.random() < 0.03 else (("a/b", "c", "d", "e") if rng.random() < 0.02 else ()),
                holds=holds,
                pinned=rng.random() < 0.05,
                trainer_state=ts,
                slim=_slim(rng),
                unit=unit,
                metrics=metrics,
                metric_problem="torch not installed" if rng.random() < 0.05 else None,
            )
        )
    ckpts.sort(key=Checkpoint.sort_key)
    resume = {}
    if ckpts and rng.random() < 0.3:
        resume[rng.choice(ckpts).name] = "latest"
    if rng.random() < 0.05:
        resume["checkpoint-gone"] = "latest"
    return Run(root, rel, tuple(ckpts), resume)


RETENTIONS: list[dict[str, object]] = [
    {},
    {"keep_last": 2, "keep_best": 1, "metric": "eval_loss", "keep_within": "1h", "max_size": 20_000},
    {"keep_last": 1, "keep_best": 2, "metric": "loss", "mode": "max", "keep_missing_metric": False},
    {"keep_last": 0, "keep_best": 1},
    {"keep_last": 3, "keep_best": 0, "keep_every_steps": 40, "min_free": 30_000},
    {"keep_total": 2, "metric": "eval_loss"},
    {"keep_total": 1},
    {"keep_total": 3, "metric": "eval_acc", "mode": "max", "max_size": 500},
    {"keep_last": 2, "keep_best": 1, "metric": "eval_loss", "keep_full_last": 1, "max_size": 1500},
    {"keep_total": 2, "metric": "eval_loss", "keep_full_last": 2, "slim_weights": "as-saved"},
    {"keep_last": 1, "keep_best": 1, "metric": "eval_loss", "keep_within": "20m", "min_free": "40%"},
    {"keep_last": 1, "keep_best": 3, "metric": "eval_missing"},
    {"keep_last": 6, "keep_best": 0, "keep_within": "3h", "min_free": "20%", "max_size": 40_000},
    {"keep_last": 4, "keep_best": 1, "metric": "eval_loss", "keep_missing_metric": False, "min_free": 25_000},
]


def scenarios() -> list[tuple[str, list[tuple[Root, list[Run]]], int, int]]:
    """(name, roots with their runs, free bytes, total bytes): every root on one filesystem."""
    rng = random.Random(20261201)
    out = []
    for k, retention in enumerate(RETENTIONS):
        for variant in range(3):
            roots = []
            for r in range(rng.choice((1, 1, 2))):
                path = Path(f"/vol{r}")
                runs = [make_run(rng, path, f"team-{i % 2}/run-{i}", rng.choice((0, 1, 2, 5, 12, 30)))
                        for i in range(rng.randrange(1, 7))]
                if rng.random() < 0.3:
                    runs.append(make_run(rng, path, ".", rng.randrange(1, 6)))
                if rng.random() < 0.5:  # NeMo's model-parallel ranks: one run each, the same steps
                    names = [f"megatron--step={s}.ckpt" for s in range(5)]
                    for m in range(rng.choice((1, 2, 3))):
                        runs.append(make_run(rng, path, f"nemo/mp_rank_0{m}", 5, names=names))
                pins = rng.choice(((), ("team-0/run-0/checkpoint-*",), ("nope/checkpoint-1", "team-1/*/ckpt[*]")))
                rules = []
                if rng.random() < 0.4:
                    rules.append({"match": "team-1/*", "keep_last": 1, "pins": ["team-1/run-1/checkpoint-5"]})
                if rng.random() < 0.3:
                    rules.append({"match": "no-such-run", "keep_best": 0})
                root = Root.model_validate({
                    "path": str(path), "retention": {**retention, "pins": list(pins)}, "runs": rules,
                })
                if r == 1 and rng.random() < 0.3:  # a command restricted to part of the root
                    root = root.restricted(("team-0",))
                    runs = [x for x in runs if root.in_scope(x.rel)]
                roots.append((root, sorted(runs, key=lambda x: x.rel)))
            out.append((f"retention {k} variant {variant}", roots, rng.choice((0, 5_000, 12_000, 16_000, 19_000, 21_000, 24_000, 60_000)), 100_000))
    out += _bench_scenarios()
    out += _policy_table_scenarios()
    return out


def _bench_scenarios() -> list[tuple[str, list[tuple[Root, list[Run]]], int, int]]:
    from bench import planning

    root = Root(path=planning.ROOT, retention=planning.RETENTION)
    free, total = 50 << 40, 100 << 40
    return [
        (f"bench {runs} x {per}", [(root, planning.make_runs(runs, per))], free, total)
        for runs, per in ((1, 10), (1, 300), (40, 10), (3, 60))
    ]


def _policy_table_scenarios() -> list[tuple[str, list[tuple[Root, list[Run]]], int, int]]:
    """test_policy.py's table of retentions and losses, planned whole."""
    from tests.policy import test_policy

    mark = next(m for m in test_policy.test_keep_rules.pytestmark if m.name == "parametrize")
    out = []
    for i, (retention, losses, _) in enumerate(mark.args[1]):
        root = Root(path=test_policy.ROOT, retention=retention)
        run = test_policy.with_losses(test_policy.STEPS, losses)
        out.append((f"test_policy.test_keep_rules[{i}]", [(root, [run])], 1 << 40, 2 << 40))
    return out


def _metric(v: float | str | None) -> object:
    return repr(v) if isinstance(v, float) and not math.isfinite(v) else v


def plan_doc(roots: list[tuple[Root, list[Run]]], free: int, total: int) -> dict[str, object]:
    plan = planner.decide(roots, space=lambda p: planner.DiskSpace(free, total), device=lambda p: 1)
    return {
        "decisions": [
            [str(d.checkpoint.root), d.checkpoint.rel, str(d.action), list(d.reasons), d.protected,
             _metric(d.metric), d.metric_source]
            for d in plan.decisions
        ],
        "warnings": list(plan.warnings),
    }


def corpus_doc() -> dict[str, object]:
    return {name: plan_doc(roots, free, total) for name, roots, free, total in scenarios()}


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    doc = corpus_doc()
    FIXTURE.write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")
    n = sum(len(v["decisions"]) for v in doc.values())  # type: ignore[arg-type]
    print(f"wrote {FIXTURE}: {len(doc)} scenarios, {n} decisions")
