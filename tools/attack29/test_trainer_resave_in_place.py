"""HF Trainer: a re-save in place killed right after the weights were written.

Reproduces: a real Trainer run (tiny GPT-2, n_embd=16) saves checkpoint-2 and checkpoint-4 into
out/. A second job into the same output_dir (a wider model, n_embd=32, save_steps=4) saves
checkpoint-4 in place and is SIGKILLed inside that save right after save_pretrained wrote
config.json and model.safetensors, before training_args.bin (Trainer._save_checkpoint writes the
weights, training_args.bin, optimizer.pt, scheduler.pt, rng_state.pth, then trainer_state.json).
checkpoint-4 now holds the new save's weights beside the old save's optimizer, scheduler, rng
state and trainer_state.json. The Trainer's own resume from it fails with either model;
checkpoint-2 resumes. The promise: checkpoint-4 is not complete ("one save" is the documented
check for exactly this), `ckptd latest` names checkpoint-2, keep_last=1 keeps checkpoint-2.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from atk import age, config, job, latest, plan, verify


def test_a_trainer_resave_killed_after_the_weights_is_not_complete(tmp_path):
    vol = tmp_path / "vol"
    out = vol / "out"
    job("trainer_job.py", "train", out, 16, 2, 4)
    age(vol, 7200)                                  # the first job ran two hours ago
    r, p = job("trainer_job.py", "train", out, 32, 4, 4, 4, check=False)
    assert p.returncode == -9, p.stderr[-2000:]     # SIGKILLed inside the save
    ck4 = out / "checkpoint-4"
    assert (ck4 / "model.safetensors").stat().st_mtime > (ck4 / "trainer_state.json").stat().st_mtime + 3000
    for width in (16, 32):
        r4, _ = job("trainer_job.py", "resume", tmp_path / f"r4-{width}", width, ck4, check=False)
        assert (r4 or {}).get("resume") != "ok", r4               # the Trainer cannot resume from it (n_embd=32: it aborts, heap corrupted)
    r2, _ = job("trainer_job.py", "resume", tmp_path / "r2", 16, out / "checkpoint-2")
    assert r2["resume"] == "ok", r2
    age(vol, 3600)                                  # the killed job died an hour ago
    cfg = config(tmp_path, vol, keep_last=1, keep_best=0)
    rc, ev = verify(cfg, ck4)
    rows = {Path(c["path"]).name: c for c in plan(cfg)["checkpoints"]}
    code, name, err = latest(cfg, out)
    assert rc != 0 and rows["checkpoint-4"]["state"] != "complete", (rc, rows["checkpoint-4"])
    assert name == str(out / "checkpoint-2"), (name, err)
    assert rows["checkpoint-2"]["action"] != "delete", rows["checkpoint-2"]


def test_the_daemon_does_not_delete_the_older_checkpoint_while_the_resave_is_in_flight(tmp_path):
    """The same re-save, not killed but still in flight: the second job stalls in the save right
    after model.safetensors (slow storage), and `ckptd run` (quiet_period 60s, keep_last=1) watches.
    While the save is in flight, checkpoint-4 must not be taken for complete: checkpoint-2 (the
    only checkpoint the Trainer can resume from) must still be there after the daemon has seen
    everything quiet for well over quiet_period."""
    import os, signal, subprocess, time
    from atk import ENV, HERE, PY
    vol = tmp_path / "vol"
    out = vol / "out"
    job("trainer_job.py", "train", out, 16, 2, 4)
    age(vol, 7200)
    cfg = config(tmp_path, vol, keep_last=1, keep_best=0)
    cfg.write_text(cfg.read_text().replace('quiet_period = "60s"', 'quiet_period = "60s"\npoll_interval = "2s"'))
    trainer = subprocess.Popen([PY, str(HERE / "trainer_job.py"), "train", str(out), "32", "4", "4", "4"],
                               env={**ENV, "HOLD": "1"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    daemon = None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = trainer.stdout.readline()
            assert line, "the trainer ended before its save"
            if line.strip() == "holding":
                break
        journal = tmp_path / "state" / "journal.jsonl"
        daemon = subprocess.Popen([PY, "-m", "ckptd", "run", "--foreground", "-c", str(cfg)], env=ENV,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 150      # quiet_period 60 s, then a decision: well within
        while time.monotonic() < deadline and (out / "checkpoint-2").exists():
            time.sleep(0.5)
        assert trainer.poll() is None          # the save is still in flight
        trashed = journal.read_text() if journal.exists() else ""
        assert (out / "checkpoint-2").exists(), trashed[-1500:]
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM); daemon.wait(30)
        os.kill(trainer.pid, signal.SIGKILL); trainer.wait()
