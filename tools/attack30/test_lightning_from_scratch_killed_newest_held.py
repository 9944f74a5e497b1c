"""HELD (regression): Lightning, two fits from scratch under one default logger; version_0's last save
was SIGKILLed while Lightning wrote it, so version_0's newest COMPLETE checkpoint is the one before.

How it was produced: lightning_kill.py (a real Trainer.fit, ModelCheckpoint(save_top_k=-1,
every_n_train_steps=2)), version_0: max_steps 6, killed inside _atomic_save of step=6 after half the
bytes (epoch=0-step=6.ckpt truncated); version_1: a fit from scratch, max_steps 20, a save every 10
(step=10, step=20): its lowest step is above version_0's highest, so the names look like a resume.
Aged 1 h with os.utime; keep_last=1 (plan, prune) and the daemon (`ckptd run --foreground`,
quiet_period 5s).

ckptd: step=6 incomplete ("not a complete zip archive"), step=4 kept ("newest complete in
.../version_0/checkpoints, a launch of its own ... (kept in doubt)"), step=2 and step=10 deleted,
step=20 kept. Lightning's own fit(ckpt_path=step=4) restores it.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from atk import age, config, job, plan, ckptd
from rootkit import cfg, daemon_until

V0 = "lightning_logs/version_0/checkpoints/"


def _experiment(tmp_path):
    exp = tmp_path / "vol" / "exp"
    job("lightning_kill.py", exp, 6, 2, 6, check=False)
    job("lightning_kill.py", exp, 20, 10)
    assert (exp / V0 / "epoch=0-step=6.ckpt").stat().st_size < (exp / V0 / "epoch=0-step=4.ckpt").stat().st_size
    r, _ = job("lightning_job.py", "load", exp / V0 / "epoch=0-step=4.ckpt")
    assert r["load"] == "ok", r
    age(tmp_path / "vol")
    return exp


def test_plan_prune_and_daemon_keep_version_0s_newest_complete(tmp_path):
    exp = _experiment(tmp_path)
    c = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    rows = {c_["path"]: c_ for c_ in plan(c)["checkpoints"]}
    assert rows[str(exp / V0 / "epoch=0-step=6.ckpt")]["state"] != "complete"
    assert rows[str(exp / V0 / "epoch=0-step=4.ckpt")]["action"] != "delete", rows
    import shutil
    d = tmp_path / "d"
    d.mkdir()
    shutil.copytree(tmp_path / "vol", d / "vol", copy_function=shutil.copy2)
    p = ckptd("prune", "-c", c)
    assert p.returncode == 0, p.stderr
    assert (exp / V0 / "epoch=0-step=4.ckpt").is_file(), p.stdout
    rc, log = daemon_until(d, cfg(d, d / "vol", quiet="5s"), words=("retention:",))
    assert (d / "vol" / "exp" / V0 / "epoch=0-step=4.ckpt").is_file(), log
