"""Lightning: two fits FROM SCRATCH under one experiment name, the second saving at a coarser
interval, are merged into one run and the first fit loses every checkpoint, its newest included.

Reproduces: real Lightning fits with the default logger (lightning_logs/version_N/checkpoints/,
ModelCheckpoint(save_top_k=-1)): version_0 a short fit from scratch (max_steps=4, a save every 2
steps: step=2, step=4), version_1 another fit from scratch (max_steps=20, a save every 10 steps:
step=10, step=20; no ckpt_path). docs/frameworks/lightning.md says a fit from scratch "is kept
apart, a run of its own with its own newest complete checkpoint protected"; ckptd tells a resume
from a fresh start only by whether the new version's lowest step is above the old one's highest,
which a from-scratch fit with a longer save interval also satisfies. The two cases cannot be told
apart from names, so this is a case of doubt, and the promise says: in doubt, keep. Required:
version_0's newest complete checkpoint (step=4, which Lightning loads) is not deleted.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from atk import age, config, job, plan


def test_a_second_fit_from_scratch_does_not_take_the_first_fits_newest(tmp_path):
    exp = tmp_path / "vol" / "exp"
    v0, _ = job("lightning_versions.py", exp, 4, 2)
    v1, _ = job("lightning_versions.py", exp, 20, 10)
    ck = sorted(exp.rglob("*.ckpt"))
    names = [str(p.relative_to(exp)) for p in ck]
    assert "lightning_logs/version_0/checkpoints/epoch=0-step=4.ckpt" in names, names
    newest0 = exp / "lightning_logs/version_0/checkpoints/epoch=0-step=4.ckpt"
    r, _ = job("lightning_job.py", "load", newest0)
    assert r["load"] == "ok", r                                   # Lightning restores it
    age(tmp_path / "vol")
    cfg = config(tmp_path, tmp_path / "vol", keep_last=2, keep_best=0)
    rows = {c["path"]: c for c in plan(cfg)["checkpoints"]}
    row = rows[str(newest0)]
    assert row["state"] == "complete", row
    assert row["action"] != "delete", row
