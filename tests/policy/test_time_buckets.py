"""keep_hourly/daily/weekly/monthly: restic's bucket semantics (internal/restic/snapshot_policy.go,
`ApplyPolicy`): newest first, keep a checkpoint when its calendar bucket differs from the last kept,
until N are kept; buckets by when each save ended, in UTC, counted back from the newest save.
Pure: steps and times in, steps kept out; no disk, no clock."""

from __future__ import annotations

import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.config import Retention
from ckptd.decide.policy import decide_run
from ckptd.model import Action, Checkpoint
from tests.support.memruns import ck, run_of


def at(text: str) -> float:
    """'2026-03-01 14:30' in UTC, as a Unix time."""
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M").replace(tzinfo=datetime.UTC).timestamp()


def kept_steps(times: dict[int, str], **rules) -> list[int]:
    run = run_of(*(ck(step, mtime=at(t)) for step, t in times.items()))
    decisions = decide_run(run, Retention(keep_last=1, keep_best=0, **rules))
    return [d.checkpoint.step for d in decisions if d.action is Action.KEEP]


HOURS = {  # two saves an hour, 10:00 to 12:30 on 1 March
    1: "2026-03-01 10:00", 2: "2026-03-01 10:30", 3: "2026-03-01 11:00",
    4: "2026-03-01 11:30", 5: "2026-03-01 12:00", 6: "2026-03-01 12:30",
}
DAYS = {  # a gap: nothing on 3 and 4 March
    1: "2026-03-01 09:00", 2: "2026-03-01 23:59", 3: "2026-03-02 00:00", 4: "2026-03-02 18:00",
    5: "2026-03-05 08:00", 6: "2026-03-05 09:00",
}
WEEKS = {  # ISO weeks: Mon 2 Mar 2026 begins week 10; Sun 1 Mar is week 9
    1: "2026-02-20 12:00", 2: "2026-02-23 12:00", 3: "2026-03-01 23:00", 4: "2026-03-02 01:00",
    5: "2026-03-08 12:00", 6: "2026-03-09 12:00",
}
MONTHS = {
    1: "2025-12-31 23:00", 2: "2026-01-15 12:00", 3: "2026-01-31 12:00", 4: "2026-03-01 00:00",
    5: "2026-03-20 00:00",
}


@pytest.mark.parametrize(("times", "rules", "expected"), [
    # keep_last=1 alone keeps the newest; each rule adds the newest of each of its last N buckets
    (HOURS, {}, [6]),
    (HOURS, {"keep_hourly": 1}, [6]),
    (HOURS, {"keep_hourly": 2}, [4, 6]),
    (HOURS, {"keep_hourly": 3}, [2, 4, 6]),
    (HOURS, {"keep_hourly": 10}, [2, 4, 6]),  # more buckets than there are: every bucket's newest
    # buckets that hold a checkpoint are counted, not calendar days: 3 and 4 March are skipped
    (DAYS, {"keep_daily": 2}, [4, 6]),
    (DAYS, {"keep_daily": 3}, [2, 4, 6]),
    (DAYS, {"keep_daily": 3, "keep_hourly": 2}, [2, 4, 5, 6]),  # unioned
    (WEEKS, {"keep_weekly": 2}, [5, 6]),  # week 11 (9 Mar) and week 10 (2-8 Mar): its newest is 8 Mar
    (WEEKS, {"keep_weekly": 3}, [3, 5, 6]),
    (WEEKS, {"keep_weekly": 4}, [1, 3, 5, 6]),  # 20 Feb (week 8); 23 Feb and 1 Mar share week 9
    (MONTHS, {"keep_monthly": 2}, [3, 5]),  # February holds none: January's newest is the 31st
    (MONTHS, {"keep_monthly": 3}, [1, 3, 5]),
])
def test_the_newest_of_each_bucket_is_kept(times, rules, expected):
    assert kept_steps(times, **rules) == expected


def test_counted_from_the_newest_save_never_from_now():
    """A run idle for a year still keeps its last N days: buckets are counted back from the newest
    save, so nothing in the decision depends on when it is made."""
    old = {s: t.replace("2026", "2019") for s, t in DAYS.items()}
    assert kept_steps(old, keep_daily=2) == kept_steps(DAYS, keep_daily=2) == [4, 6]


def test_the_reasons_name_the_rule_and_its_bucket():
    run = run_of(*(ck(step, mtime=at(t)) for step, t in DAYS.items()))
    r = Retention(keep_last=1, keep_best=0, keep_daily=2)
    d = {d.checkpoint.step: d for d in decide_run(run, r)}
    assert "keep_daily=2 (newest of day 2026-03-02 UTC)" in d[4].reasons
    assert "keep_daily=2 (newest of day 2026-03-05 UTC)" in d[6].reasons
    assert d[1].action is Action.DELETE
    assert d[1].reasons == ("outside keep_last=1 and keep_daily=2",)


def test_a_config_without_time_buckets_describes_itself_as_before():
    assert Retention().describe() == "keep_last=2 and keep_best=1 (trainer's best)"


times = st.lists(st.integers(min_value=1_500_000_000, max_value=1_900_000_000), min_size=1, max_size=30, unique=True)


@settings(max_examples=200, deadline=None)
@given(times=times, hourly=st.integers(0, 5), daily=st.integers(0, 5), weekly=st.integers(0, 5),
       monthly=st.integers(0, 5), last=st.integers(0, 3))
def test_the_newest_is_never_dropped_and_each_rule_keeps_at_most_n(times, hourly, daily, weekly, monthly, last):
    ckpts: list[Checkpoint] = [ck(i + 1, mtime=float(t)) for i, t in enumerate(sorted(times))]
    r = Retention(keep_last=last, keep_best=0, keep_hourly=hourly, keep_daily=daily, keep_weekly=weekly,
                  keep_monthly=monthly)
    decisions = decide_run(run_of(*ckpts), r)
    by_step = {d.checkpoint.step: d for d in decisions}
    newest = max(ckpts, key=lambda c: c.written_at)
    assert by_step[newest.step].action is Action.KEEP
    for key, n in (("keep_hourly", hourly), ("keep_daily", daily), ("keep_weekly", weekly),
                   ("keep_monthly", monthly)):
        holders = [d for d in decisions if any(x.startswith(f"{key}=") for x in d.reasons)]
        assert len(holders) <= n
        if n:
            assert any(x.startswith(f"{key}=") for x in by_step[newest.step].reasons)
        # one kept per bucket: no two holders share the bucket they are the newest of
        buckets = [next(x for x in d.reasons if x.startswith(f"{key}=")).split("newest of ")[1] for d in holders]
        assert len(buckets) == len(set(buckets))


# --- the command line: plan and prune take retention flags for one call, as restic forget does ---


def demo_volume(tmp_path, state_env):
    """`ckptd demo`'s volume (its own hand-made example checkpoints: what is tested here is the
    policy and its flags), roberta-mlm's four complete checkpoints saved a day apart."""
    import os
    import time

    from ckptd.cli.demo_volume import age
    from tests.support.common import run_ckptd

    assert run_ckptd("demo", tmp_path / "demo", env=state_env).returncode == 0
    config = tmp_path / "demo" / "ckptd.toml"
    run = tmp_path / "demo" / "experiments" / "roberta-mlm"
    now = time.time() - 3600
    for days, name in enumerate(["checkpoint-2000", "checkpoint-1500", "checkpoint-1000", "checkpoint-500"]):
        age(run / name, now - days * 86400)
    os.utime(run, (now, now))
    return config


def plan_rows(config, state_env, *flags):
    import json

    from tests.support.common import run_ckptd

    proc = run_ckptd("plan", "-c", config, "--json", *flags, env=state_env)
    assert proc.returncode == 0, proc.stderr
    return {f"{c['run']}/{c['path'].rsplit('/', 1)[1]}": c for c in json.loads(proc.stdout)["checkpoints"]}


def test_retention_flags_override_the_config_for_one_call(tmp_path, state_env):
    from tests.support.common import run_ckptd

    config = demo_volume(tmp_path, state_env)
    kept = lambda rows: sorted(k for k, c in rows.items() if c["action"] == "keep" and c["state"] == "complete")  # noqa: E731
    # the config: keep_last=2, keep_best=1 by eval_loss (checkpoint-500 is the best)
    assert [k for k in kept(plan_rows(config, state_env)) if k.startswith("roberta")] == [
        "roberta-mlm/checkpoint-1500", "roberta-mlm/checkpoint-2000", "roberta-mlm/checkpoint-500"]
    rows = plan_rows(config, state_env, "--keep-last", "1", "--keep-best", "0")
    assert [k for k in kept(rows) if k.startswith("roberta")] == ["roberta-mlm/checkpoint-2000"]
    # --keep-last overrides the run rule that sets it too (team-a/* keeps 2 by its own rule)
    assert [k for k in kept(rows) if k.startswith("team-a")] == ["team-a/gpt-small/iter_0004000"]
    rows = plan_rows(config, state_env, "--keep-last", "1", "--keep-best", "0", "--keep-daily", "3")
    assert [k for k in kept(rows) if k.startswith("roberta")] == [
        "roberta-mlm/checkpoint-1000", "roberta-mlm/checkpoint-1500", "roberta-mlm/checkpoint-2000"]
    [why] = [r for r in rows["roberta-mlm/checkpoint-1000"]["reasons"] if r.startswith("keep_daily=3")]
    assert why.startswith("keep_daily=3 (newest of day ") and why.endswith(" UTC)")
    assert rows["roberta-mlm/checkpoint-500"]["reasons"] == ["outside keep_last=1 and keep_daily=3"]
    rows = plan_rows(config, state_env, "--keep-last", "1", "--keep-best", "2", "--metric", "eval_loss",
                     "--mode", "max")  # the worst two by eval_loss: 1000 (1.02), 1500 (0.97)
    assert [k for k in kept(rows) if k.startswith("roberta")] == [
        "roberta-mlm/checkpoint-1000", "roberta-mlm/checkpoint-1500", "roberta-mlm/checkpoint-2000"]
    # and prune does what plan said, with the same flags
    proc = run_ckptd("prune", "-c", config, "--keep-last", "1", "--keep-best", "0", env=state_env)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "demo" / "experiments" / "roberta-mlm"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-2000", "checkpoint-2500", "checkpoint-3000"]


def test_a_bad_retention_flag_is_one_line_naming_the_flag(tmp_path, state_env):
    from tests.support.common import run_ckptd

    config = demo_volume(tmp_path, state_env)
    proc = run_ckptd("plan", "-c", config, "--keep-within", "soon", env=state_env)
    assert (proc.returncode, proc.stderr) == (
        78, "ckptd: --keep-within: expected a duration like '90s', '10m', '6h' or '7d' (got 'soon')\n")
    proc = run_ckptd("prune", "-c", config, "--keep-last", "-1", env=state_env)
    assert proc.returncode == 64 and "--keep-last: must be >= 0 (got '-1')" in proc.stderr
