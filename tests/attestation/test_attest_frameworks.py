"""The integrations on the frameworks' own saves (attestgen.py): a real 2-process HF Trainer run with
`AttestCallback`, the same run killed in its last save (both ranks before their rng states), and
accelerate's `save_state` with the hook; judged by the real `ckptd plan` and by the engine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age
from ckptd.config import Root
from ckptd.decide.planner import Scanner
from ckptd.judge import attestation
from ckptd.model import ATTESTED, COMMIT_RECORDS, SAVE_LEASE, State
from tests.support import child_pythonpath, fwgen
from tests.support.common import run_ckptd

pytestmark = pytest.mark.frameworks


@pytest.fixture(scope="module")
def attested(tmp_path_factory) -> Path:
    for fw in ("trainer", "accelerate"):
        if (why := fwgen.missing(fw)) is not None:
            pytest.skip(why)
    out = tmp_path_factory.mktemp("attestgen")
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    proc = subprocess.run([sys.executable, "-m", "tests.support.attestgen", str(out)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def records(ck: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((ck / ".ckptd").glob("*.json"))}


def scan(root: Path, now: float):
    return {c.rel: c for run in Scanner(Root(path=root, max_depth=4)).runs(now=now) for c in run.checkpoints}


def newest(ck: Path) -> float:
    return max(p.stat().st_mtime for p in ck.rglob("*"))


def test_the_trainer_callback_records_each_processs_part_of_each_save(attested):
    ck = attested / "trainer-whole" / "checkpoint-4"
    recs = records(ck)
    assert sorted(recs) == ["commit-rank0-of-2.json", "commit-rank1-of-2.json"]  # no lease left
    files = {name: {f["path"] for f in r["files"]} for name, r in recs.items()}
    assert {"trainer_state.json", "model.safetensors", "rng_state_0.pth"} <= files["commit-rank0-of-2.json"]
    assert "rng_state_1.pth" in files["commit-rank1-of-2.json"]
    assert {r["step"] for r in recs.values()} == {4}
    # a second after its last write, inside the quiet period: complete on its records
    c = scan(attested, newest(ck) + 1)["trainer-whole/checkpoint-4"]
    assert c.state is State.COMPLETE, [str(k) for k in c.checks]
    assert attestation.committed_summary(c.checks).startswith("committed by 2/2 ranks at ")


def test_a_rank_killed_mid_save_never_writes_its_record(attested, tmp_path):
    root = tmp_path / "vol"
    shutil.copytree(attested / "trainer-killed", root / "trainer-killed")
    ck = root / "trainer-killed" / "checkpoint-4"
    # killed with both ranks held before their rng states: neither is there, nor rank 0's trainer_state.json
    assert not {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} & {p.name for p in ck.iterdir()}
    assert sorted(records(ck)) == ["lease-rank0-of-2.json", "lease-rank1-of-2.json"]  # killed: no record
    c = scan(root, time.time() + 3600)["trainer-killed/checkpoint-4"]
    if c.state is State.WRITING:  # looked at within STALE_AFTER of the kill: leases still live
        # the live lease holds it in flight (trainer_state.json and the rng states are missing too)
        assert SAVE_LEASE in [k.name for k in c.checks if k.verdict != "passed"], [str(k) for k in c.checks]
    stopped = time.time() - attestation.STALE_AFTER - 60  # their heartbeats stopped that long ago
    for lease in (ck / ".ckptd").glob("lease-*"):
        os.utime(lease, (stopped, stopped))
    c = scan(root, time.time() + 3600)["trainer-killed/checkpoint-4"]
    assert c.state is State.INCOMPLETE
    why = next(k.detail for k in c.checks if k.name == COMMIT_RECORDS)
    assert why.startswith("abandoned: rank 0's save stopped at ") and "(and 1 more)" in why
    assert scan(root, time.time() + 3600)["trainer-killed/checkpoint-2"].state is State.COMPLETE


def test_plan_keeps_the_killed_save_and_the_newest_attested_one(attested, tmp_path):
    root = tmp_path / "vol"
    shutil.copytree(attested, root)
    age(root / "trainer-killed" / "checkpoint-4", time.time() - 3600)  # killed an hour ago, leases and all
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\nmax_depth = 4\n"
                   "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {os.path.relpath(c["path"], root): c for c in json.loads(proc.stdout)["checkpoints"]}
    assert rows["trainer-killed/checkpoint-4"]["state"] == "incomplete"
    assert rows["trainer-killed/checkpoint-4"]["action"] == "keep"
    assert rows["trainer-killed/checkpoint-2"]["action"] == "keep"  # the newest complete
    assert rows["trainer-whole/checkpoint-2"]["action"] == "delete"
    assert rows["accelerate/step_2"]["action"] == "keep" and rows["accelerate/step_1"]["action"] == "delete"


def test_accelerates_save_state_with_the_hook(attested):
    ck = attested / "accelerate" / "step_2"
    [(name, rec)] = records(ck).items()
    assert name == "commit-rank0-of-1.json"
    listed = {f["path"] for f in rec["files"]}
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl"} <= listed, listed
    c = scan(attested, newest(ck) + 1)["accelerate/step_2"]
    assert c.state is State.COMPLETE and any(k.name == ATTESTED for k in c.checks), [str(k) for k in c.checks]


def test_latest_prefers_attested_saves_and_plan_says_who_committed(attested, tmp_path):
    """A complete checkpoint-6 without records, copied in beside the callback's attested saves
    (the records left behind): `latest` names the newest attested one and says why not the copy."""
    run = tmp_path / "vol" / "trainer-whole"
    shutil.copytree(attested / "trainer-whole", run)
    shutil.copytree(run / "checkpoint-4", run / "checkpoint-6", ignore=shutil.ignore_patterns(".ckptd"))
    age(run / "checkpoint-6", time.time() - 600)
    proc = run_ckptd("latest", run, "--quiet-period", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(run / "checkpoint-4")
    assert "passed over checkpoint-6: complete, but without the commit records" in proc.stderr
    assert "ckptd: checkpoint-4: committed by 2/2 ranks at " in proc.stderr
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{run.parent}'\n"
                   "quiet_period = '1s'\nallow_short_quiet_period = true\n[roots.retention]\nkeep_last = 3\nkeep_best = 0\n")
    table = run_ckptd("plan", "-c", cfg)
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if " checkpoint-4 " in line)
    assert "committed by 2/2 ranks at " in row
    doc = json.loads(run_ckptd("plan", "-c", cfg, "--json").stdout)
    by_name = {os.path.basename(c["path"]): c for c in doc["checkpoints"]}
    assert by_name["checkpoint-4"]["committed"].startswith("committed by 2/2 ranks at ")
    assert "committed" not in by_name["checkpoint-6"]
    shown = run_ckptd("verify", "-c", cfg, run / "checkpoint-4")
    assert shown.returncode == 0, shown.stderr
    assert "passed   attested" in shown.stdout and "committed by 2/2 ranks at " in shown.stdout
