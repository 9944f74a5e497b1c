"""Planning gave the same plan before it was made faster: every decision (action, reasons, protection,
metric and its source) and every warning, on tests/support/plancorpus.py's corpus (varied hand-made runs, the
benchmark's runs and test_policy.py's table), against the plans recorded in tests/data/plan_decisions.json
by the code before (commit 908e05b). A change that means to change decisions regenerates the file
(`python3 -m tests.support.plancorpus`) and says so in its commit."""

from __future__ import annotations

import json

import pytest

from tests.support.plancorpus import FIXTURE, plan_doc, scenarios

RECORDED = json.loads(FIXTURE.read_text())
SCENARIOS = scenarios()


def test_the_corpus_is_the_recorded_one():
    assert sorted(name for name, *_ in SCENARIOS) == sorted(RECORDED)


@pytest.mark.parametrize("case", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_plans_are_unchanged(case):
    name, roots, free, total = case
    got = json.loads(json.dumps(plan_doc(roots, free, total)))  # tuples as lists, as recorded
    want = RECORDED[name]
    assert got["warnings"] == want["warnings"]
    for g, w in zip(got["decisions"], want["decisions"], strict=True):
        assert g == w


def test_a_decision_holds_every_field_its_init_is_given():
    """`Decision.__init__` is written out (one setattr instead of six): it sets every field, in order."""
    from dataclasses import fields, replace

    from ckptd.decide.policy import Decision
    from ckptd.model import Action

    c = SCENARIOS[0][1][0][1][0].checkpoints[0]
    d = Decision(c, Action.KEEP, ("x",), True, 0.5, "trainer_state")
    assert list(vars(d)) == [f.name for f in fields(Decision)]
    assert [getattr(d, f.name) for f in fields(Decision)] == [c, Action.KEEP, ("x",), True, 0.5, "trainer_state"]
    assert replace(d, action=Action.DELETE) == Decision(c, Action.DELETE, ("x",), True, 0.5, "trainer_state")
    assert Decision(c, Action.KEEP, ()) == Decision(c, Action.KEEP, (), False, None, None)
