"""keep_best's direction when the config names no mode: the Trainer's own rule (greater is better unless
the metric name ends in loss), on real Trainer run-states."""

from __future__ import annotations

import json

import pytest

from ckptd.config import Retention
from tests.support.common import run_ckptd
from tests.support.rtkit import actions, config, trainer_run

# --- Metric direction as the Trainer infers it ---------------------------------------------------


@pytest.mark.parametrize(
    ("metric", "mode"),
    [("eval_loss", "min"), ("loss", "min"), ("val_loss", "min"), ("eval_accuracy", "max"), ("accuracy", "max"),
     ("eval_f1", "max"), ("eval_bleu", "max"), ("eval_samples_per_second", "max"), ("eval_wer", "min"),
     ("perplexity", "min"), ("eval_rmse", "min"), ("eval_error", "min")],
)
def test_a_metric_without_mode_goes_the_trainers_way(metric, mode):
    """transformers training_args.py TrainingArguments.__post_init__: greater_is_better unset is
    `not metric_for_best_model.endswith("loss")`; a known lower-is-better name is minimised too."""
    from ckptd.config import inferred_mode

    assert inferred_mode(metric) == mode
    assert Retention(metric=metric).direction == mode
    other = "max" if mode == "min" else "min"
    assert Retention(metric=metric, mode=other).direction == other  # mode set explicitly wins


@pytest.mark.frameworks
def test_keep_best_by_a_metric_not_ending_in_loss_keeps_the_highest(trainer_volume, tmp_path):
    """`metric = "eval_samples_per_second"` (the Trainer logs it with every evaluation), no `mode`:
    ckptd minimised every metric, so it kept the slowest evaluation and deleted the best by the
    Trainer's own reckoning. Now: the highest is kept, and plan and check-config say 'max' was
    inferred; `mode = "min"` still minimises."""
    root, run = trainer_run(trainer_volume, tmp_path)
    history = json.loads((run / "checkpoint-8" / "trainer_state.json").read_text())["log_history"]
    speed = {e["step"]: e["eval_samples_per_second"] for e in history if "eval_samples_per_second" in e}
    fastest, slowest = max(speed, key=speed.get), min(speed, key=speed.get)
    assert fastest != slowest
    cfg = config(tmp_path, root, keep_last=1, keep_best=1, metric="eval_samples_per_second")
    plan = run_ckptd("plan", "-c", cfg, "--json")
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    kept = {k for k, a in actions(plan.stdout).items() if a == "keep" and k.startswith("run-state/")}
    assert kept == {f"run-state/checkpoint-{s}" for s in {fastest, 8, 10}}
    assert any("'max' inferred" in n and "eval_samples_per_second" in n for n in doc["notes"])
    checked = run_ckptd("check-config", "-c", cfg)
    assert checked.returncode == 0, checked.stderr
    assert "'max' inferred" in checked.stderr
    explicit = config(tmp_path, root, keep_last=1, keep_best=1, metric="eval_samples_per_second", mode="min")
    plan = run_ckptd("plan", "-c", explicit, "--json")
    kept = {k for k, a in actions(plan.stdout).items() if a == "keep" and k.startswith("run-state/")}
    assert kept == {f"run-state/checkpoint-{s}" for s in {slowest, 8, 10}}
    assert json.loads(plan.stdout)["notes"] == []
