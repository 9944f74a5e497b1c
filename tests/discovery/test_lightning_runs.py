"""A Lightning experiment is one run across its version_N directories, for retention (plan, prune,
the daemon) and `ckptd latest` alike.

The checkpoints are written by Lightning's own Trainer and ModelCheckpoint (CPU, one device, in one
subprocess for every fit): each `Trainer.fit` with a logger writes into a new
`<save_dir>/<name>/version_N/checkpoints/` (lightning/pytorch/callbacks/model_checkpoint.py
__resolve_ckpt_dir, the loggers' _get_next_version), a fit resumed with `ckpt_path` included, and
then carries on the step count. A fit from scratch under the same name starts it afresh.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ckptd import latest
from ckptd.config import Root, load_config
from ckptd.decide.planner import Scanner, decide
from ckptd.journal import Journal
from ckptd.model import Run
from ckptd.removal.outcome import Outcome
from ckptd.removal.reaper import Reaper
from tests.support.common import run_ckptd
from tests.support.daemonproc import DaemonProc, write_config
from tests.support.fwgen import LIGHTNING_TINY

pytestmark = pytest.mark.frameworks

FITS = LIGHTNING_TINY + textwrap.dedent('''
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    def fit(root, epochs, ckpt_path=None, logger=True, every=1):
        ck = ModelCheckpoint(save_top_k=-1, every_n_epochs=every, save_last=True)
        trainer = pl.Trainer(default_root_dir=root, max_epochs=epochs, accelerator="cpu", devices=1,
                             callbacks=[ck], logger=logger, enable_progress_bar=False,
                             enable_model_summary=False, limit_train_batches=2)
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
        return ck.dirpath
    out = sys.argv[1]
    dirs = {}
    # resumed: version_0 saves steps 2, 4; version_1 resumes from its last.ckpt and saves 6, 8
    dirs["resumed/0"] = fit(f"{out}/resumed", 2)
    dirs["resumed/1"] = fit(f"{out}/resumed", 4, ckpt_path=f"{dirs['resumed/0']}/last.ckpt")
    # fresh: version_0 saves 2, 4; version_1 is a fit from scratch: 2, 4, 6 again
    dirs["fresh/0"] = fit(f"{out}/fresh", 2)
    dirs["fresh/1"] = fit(f"{out}/fresh", 3)
    # coarse: version_0 saves 2, 4; version_1 a fit from scratch saving every 5 epochs: 10, 20
    dirs["coarse/0"] = fit(f"{out}/coarse", 2)
    dirs["coarse/1"] = fit(f"{out}/coarse", 10, every=5)
    # a logger with a name of its own: <save_dir>/<name>/version_N/checkpoints
    dirs["named/0"] = fit(f"{out}/x", 1, logger=CSVLogger(f"{out}/logs", name="exp1"))
    dirs["named/1"] = fit(f"{out}/x", 2, ckpt_path=f"{dirs['named/0']}/last.ckpt",
                          logger=CSVLogger(f"{out}/logs", name="exp1"))
    print(__import__("json").dumps(dirs))
''')

V0, V1 = "lightning_logs/version_0/checkpoints", "lightning_logs/version_1/checkpoints"
OLD = 7200  # the fits' files are two hours old in each copy: quiet


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lightning-fits")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", FITS, str(out)], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dirs = {k: os.path.relpath(v, out) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    # What the tests rest on, from Lightning itself: a resumed fit writes version_1, and the steps
    # carry on; a fit from scratch restarts them; a named logger's versions are under its name.
    assert dirs == {"resumed/0": f"resumed/{V0}", "resumed/1": f"resumed/{V1}", "fresh/0": f"fresh/{V0}",
                    "fresh/1": f"fresh/{V1}", "coarse/0": f"coarse/{V0}", "coarse/1": f"coarse/{V1}", "named/0": "logs/exp1/version_0/checkpoints",
                    "named/1": "logs/exp1/version_1/checkpoints"}
    assert ckpts(out / "resumed" / V0) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    assert ckpts(out / "resumed" / V1) == ["epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"]
    assert ckpts(out / "coarse" / V1) == ["epoch=4-step=10.ckpt", "epoch=9-step=20.ckpt", "last.ckpt"]
    assert ckpts(out / "fresh" / V1) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt",
                                         "last.ckpt"]
    return out, dirs


def volume(fits, dest: Path) -> Path:
    """A copy of the fits' volume, every entry OLD seconds old."""
    src, _ = fits
    shutil.copytree(src, dest, symlinks=True)
    then = time.time() - OLD
    for base, dirs, files in os.walk(dest):
        for n in [*dirs, *files]:
            os.utime(os.path.join(base, n), (then, then), follow_symlinks=False)
    return dest


def ckpts(d: Path) -> list[str]:
    return sorted(os.listdir(d))


def config(tmp_path: Path, root: Path, keep_last: int, runs: str = "") -> Path:
    return write_config(tmp_path / "c.toml", root, tmp_path / "state",
                        root_extra="quiet_period = '5s'\n", retention=f"keep_last = {keep_last}\n" + runs)


def actions(plan_json: str) -> dict[str, str]:
    doc = json.loads(plan_json)
    return {os.path.relpath(c["path"], doc["roots"][0]): c["action"] for c in doc["checkpoints"]}


def planned(cfg: Path, prefix: str) -> tuple[dict[str, str], str]:
    """`ckptd plan --json`'s action for each checkpoint under `prefix`, and the plan itself."""
    plan = run_ckptd("plan", "-c", cfg, "--json")
    assert plan.returncode == 0, plan.stderr
    return {k: v for k, v in actions(plan.stdout).items() if k.startswith(prefix)}, plan.stdout


def reasons(plan_json: str, rel: str) -> list[str]:
    doc = json.loads(plan_json)
    return next(c["reasons"] for c in doc["checkpoints"] if os.path.relpath(c["path"], doc["roots"][0]) == rel)


LAUNCH = "a launch of its own"  # why each version's newest complete checkpoint is kept (rules._anchors)


def test_plan_latest_and_prune_take_a_resumed_experiment_as_one_run(fits, tmp_path):
    """keep_last=2 over the experiment: version_0's step 2 is its oldest and goes; version_1's two
    stay, the newest complete among them, which is what `ckptd latest` names; version_0's own newest
    stays too (a fit from scratch saving at a coarser interval looks the same as this resume); every
    version's last.ckpt stays."""
    root = volume(fits, tmp_path / "vol")
    cfg = config(tmp_path, root, 2)
    got, plan = planned(cfg, "resumed/")
    assert got == {f"resumed/{V0}/epoch=0-step=2.ckpt": "delete", f"resumed/{V0}/epoch=1-step=4.ckpt": "keep",
                   f"resumed/{V1}/epoch=2-step=6.ckpt": "keep", f"resumed/{V1}/epoch=3-step=8.ckpt": "keep"}
    assert any(LAUNCH in r for r in reasons(plan, f"resumed/{V0}/epoch=1-step=4.ckpt"))
    named = run_ckptd("latest", "-c", cfg, root / "resumed")
    assert named.returncode == 0, named.stderr
    assert named.stdout.strip() == str(root / "resumed" / V1 / "epoch=3-step=8.ckpt")
    proc = run_ckptd("prune", "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    assert ckpts(root / "resumed" / V0) == ["epoch=1-step=4.ckpt", "last.ckpt"]
    assert ckpts(root / "resumed" / V1) == ["epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"]
    assert latest(root / "resumed", config=cfg) == root / "resumed" / V1 / "epoch=3-step=8.ckpt"


def test_the_daemon_takes_a_resumed_experiment_as_one_run(fits, tmp_path):
    """`ckptd run` with keep_last=1: the experiment's older saves go (version_0's step 2 and
    version_1's step 6), its newest complete, version_0's own newest and each version's last.ckpt
    stay, and `ckptd latest` names the experiment's newest."""
    root = volume(fits, tmp_path / "vol")
    for other in ("fresh", "coarse", "logs", "x"):
        shutil.rmtree(root / other, ignore_errors=True)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="quiet_period = '0.3s'\nallow_short_quiet_period = true\n"
                                  "observer = 'polling'\npoll_interval = '0.3s'",
                       retention="keep_last = 1")
    with DaemonProc("-c", cfg) as daemon:
        daemon.wait_message("ready")
        daemon.wait_for(lambda line: line.get("message", "").startswith("deleted "), count=2, timeout=60)
    assert ckpts(root / "resumed" / V0) == ["epoch=1-step=4.ckpt", "last.ckpt"]
    assert ckpts(root / "resumed" / V1) == ["epoch=3-step=8.ckpt", "last.ckpt"]
    named = run_ckptd("latest", "-c", cfg, root / "resumed")
    assert named.stdout.strip() == str(root / "resumed" / V1 / "epoch=3-step=8.ckpt"), named.stderr


def test_a_run_rule_matches_the_experiment_and_the_full_old_path_still_matches(fits, tmp_path):
    """`match = "resumed"` names the experiment (the directory holding lightning_logs/), and
    `match = "logs/exp1"` a named logger's; a rule naming one version's full path keeps applying to
    that version alone (then the versions are not merged: their rules differ). No 'matches no run'
    warning for the experiment's name. Before, `match = "resumed"` matched nothing."""
    root = volume(fits, tmp_path / "vol")
    runs = ("[[roots.runs]]\nmatch = 'resumed'\nkeep_last = 3\n"
            "[[roots.runs]]\nmatch = 'logs/exp1'\nkeep_last = 1\n"
            f"[[roots.runs]]\nmatch = 'fresh/{V0}'\nkeep_last = 5\n")
    cfg = config(tmp_path, root, 1, runs)
    plan = run_ckptd("plan", "-c", cfg, "--json")
    assert plan.returncode == 0, plan.stderr
    assert "matches no run" not in plan.stderr
    got = actions(plan.stdout)
    resumed = {k: v for k, v in got.items() if k.startswith("resumed/")}
    assert resumed == {f"resumed/{V0}/epoch=0-step=2.ckpt": "delete", f"resumed/{V0}/epoch=1-step=4.ckpt": "keep",
                       f"resumed/{V1}/epoch=2-step=6.ckpt": "keep", f"resumed/{V1}/epoch=3-step=8.ckpt": "keep"}
    named = {k: v for k, v in got.items() if k.startswith("logs/")}
    assert named == {"logs/exp1/version_0/checkpoints/epoch=0-step=2.ckpt": "keep",
                     "logs/exp1/version_1/checkpoints/epoch=1-step=4.ckpt": "keep"}
    # taken together with version_1 (else it would be its own run's newest, not a launch's)
    assert any(LAUNCH in r for r in reasons(plan.stdout, "logs/exp1/version_0/checkpoints/epoch=0-step=2.ckpt"))
    assert got[f"fresh/{V0}/epoch=0-step=2.ckpt"] == "keep"  # keep_last=5 on version_0's own path
    check = run_ckptd("check-config", "-c", cfg)
    assert "matches no run" not in check.stderr + check.stdout


def test_a_fit_from_scratch_in_a_new_version_is_kept_apart(fits, tmp_path):
    """version_1 of `fresh` restarted the step count (2, 4, 6 beside version_0's 2, 4): not a
    continuation of version_0, so its steps are not compared with version_0's. With the experiment's
    rule keep_last=1, each launch keeps its own newest (version_0's step 4, version_1's step 6);
    `ckptd latest` names the highest step, version_1's 6, which is kept. Merged by step, version_0's
    step 4 would go as older than version_1's 6; before, the rule matched nothing (keep_last=3)."""
    root = volume(fits, tmp_path / "vol")
    cfg = config(tmp_path, root, 3, "[[roots.runs]]\nmatch = 'fresh'\nkeep_last = 1\n")
    got, _ = planned(cfg, "fresh/")
    assert got == {f"fresh/{V0}/epoch=0-step=2.ckpt": "delete", f"fresh/{V0}/epoch=1-step=4.ckpt": "keep",
                   f"fresh/{V1}/epoch=0-step=2.ckpt": "delete", f"fresh/{V1}/epoch=1-step=4.ckpt": "delete",
                   f"fresh/{V1}/epoch=2-step=6.ckpt": "keep"}
    assert latest(root / "fresh", config=cfg) == root / "fresh" / V1 / "epoch=2-step=6.ckpt"


def test_a_fit_from_scratch_saving_at_a_coarser_interval_keeps_its_newest(fits, tmp_path):
    """version_1 of `coarse` is a fit from scratch saving every 5 epochs (steps 10, 20): its lowest
    step is above version_0's highest (4), as a resume's would be, so the versions are taken
    together. keep_last=2 keeps version_1's two and version_0's step 2 goes, but version_0's newest
    (step 4, which Lightning loads) stays: names cannot tell this fit from a resume."""
    root = volume(fits, tmp_path / "vol")
    cfg = config(tmp_path, root, 2)
    got, plan = planned(cfg, "coarse/")
    assert got == {f"coarse/{V0}/epoch=0-step=2.ckpt": "delete", f"coarse/{V0}/epoch=1-step=4.ckpt": "keep",
                   f"coarse/{V1}/epoch=4-step=10.ckpt": "keep", f"coarse/{V1}/epoch=9-step=20.ckpt": "keep"}
    assert any(LAUNCH in r for r in reasons(plan, f"coarse/{V0}/epoch=1-step=4.ckpt"))
    proc = run_ckptd("prune", "-c", cfg)
    assert proc.returncode == 0, proc.stderr
    assert ckpts(root / "coarse" / V0) == ["epoch=1-step=4.ckpt", "last.ckpt"]


def test_the_reaper_keeps_version_0_when_the_experiments_newest_is_gone(fits, tmp_path):
    """The reaper re-checks the anchors of the run the plan decided: version_1's newest, for a
    deletion in version_0. Taken away between plan and deletion, nothing of version_0 goes."""
    root = volume(fits, tmp_path / "vol")
    cfg = load_config(config(tmp_path, root, 1))
    scanner = Scanner(cfg.roots[0])
    plan = decide([(cfg.roots[0], scanner.runs(now=time.time()))])
    doomed = [d for d in plan.deletions if d.checkpoint.run == f"resumed/{V0}"]
    assert [d.checkpoint.name for d in doomed] == ["epoch=0-step=2.ckpt"]
    (root / "resumed" / V1 / "epoch=3-step=8.ckpt").unlink()
    ours = [d for d in plan.decisions if d.checkpoint.run.startswith("resumed/")]
    results = Reaper(scanner, Journal(tmp_path / "state"), dry_run=False).execute(ours)
    assert {r.decision.checkpoint.rel: r.outcome for r in results} == {
        f"resumed/{V0}/epoch=0-step=2.ckpt": Outcome.REFUSED, f"resumed/{V1}/epoch=2-step=6.ckpt": Outcome.REFUSED}
    assert all("epoch=3-step=8.ckpt is gone" in r.detail for r in results), [r.detail for r in results]
    assert ckpts(root / "resumed" / V0) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]


def _run(rel: str, steps: list[int], unit: str = "step") -> Run:
    from ckptd.model import Check, Checkpoint, Verdict

    ok = (Check("quiet", Verdict.PASSED, ""),)
    return Run(Path("/vol"), rel, tuple(Checkpoint(Path("/vol"), rel, f"epoch=0-step={s}.ckpt", s, "lightning", ok,
                                                   unit=unit) for s in steps))


def test_versions_are_merged_while_the_step_count_carries_on_and_kept_apart_where_it_restarts():
    """version_1 resumed from version_0 (steps on), version_2 from scratch (steps again), version_3
    resumed from version_2: two runs, version_0+1 and version_2+3, each ordered by step; a version
    numbered by epoch is compared with no step; another experiment and a plain directory are their
    own runs, unchanged."""
    from ckptd.decide.planner import experiments

    root = Root(path=Path("/vol"))
    v = "exp/lightning_logs/version_{}/checkpoints"
    runs = [_run(v.format(0), [2, 4]), _run(v.format(1), [6, 8]), _run(v.format(2), [2, 4]),
            _run(v.format(3), [6]), _run(v.format(4), [7], unit="epoch"), _run("other/lightning_logs/version_0/checkpoints", [2]),
            _run("plain", [1])]
    got = [(r.rel, [c.rel.split("/")[2] + f"@{c.step}" for c in r.checkpoints] if r.rel == "exp" else len(r.checkpoints))
           for r in experiments(root, runs)]
    assert got == [
        ("exp", ["version_0@2", "version_0@4", "version_1@6", "version_1@8"]),
        ("exp", ["version_2@2", "version_2@4", "version_3@6"]),
        (v.format(4), 1),
        ("other/lightning_logs/version_0/checkpoints", 1),
        ("plain", 1),
    ]
