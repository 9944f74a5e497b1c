"""A checkpoint copied in by a parallel, chunked copier that died partway (AzCopy, aria2c with
preallocation, rclone multi-thread --inplace write into the final name: the file is created at its
full size first, chunks land in the order their transfers finish).

Reproduces: real Lightning saves (ModelCheckpoint, save_top_k=-1, every 2 steps) are restored into
a volume: epoch=0-step=2.ckpt copied whole with its mtime (cp -p), epoch=0-step=4.ckpt by
chunkcopy.py (4 chunks, the last chunk first), SIGKILLed after the tail chunk landed. The file has
its full size and ends in a whole zip central directory; its first three quarters are zeros (no
local headers, no data.pkl). Lightning's own loader (Trainer.fit(ckpt_path=...), torch.load) fails
on it; epoch=0-step=2.ckpt loads. The promise: step=4 is not complete, `ckptd latest` names step=2,
keep_last=1 keeps step=2. A second case does the same to one DeepSpeed rank's optimizer shard.
"""
import os, shutil, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from atk import ENV, HERE, PY, age, config, job, latest, plan, verify


def chunk_copy_killed(src, dst, nchunks=4, order="3,2,1,0", stop_after=1, timeout=60):
    p = subprocess.Popen([PY, str(HERE / "chunkcopy.py"), str(src), str(dst), str(nchunks), order, str(stop_after)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if line.strip() == "holding":
            break
        assert line, "copier ended early"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert os.path.getsize(dst) == os.path.getsize(src)


def test_a_lightning_ckpt_whose_head_chunk_never_landed_is_not_complete(tmp_path):
    src = tmp_path / "src" / "exp"
    job("lightning_job.py", "fit", src, 4)
    a, b = src / "epoch=0-step=2.ckpt", src / "epoch=0-step=4.ckpt"
    assert a.exists() and b.exists()
    run = tmp_path / "vol" / "exp"
    run.mkdir(parents=True)
    subprocess.run(["cp", "-p", str(a), str(run / a.name)], check=True)
    chunk_copy_killed(b, run / b.name)
    ok, _ = job("lightning_job.py", "load", run / a.name)
    bad, _ = job("lightning_job.py", "load", run / b.name)
    assert ok["load"] == "ok", ok
    assert bad["load"] != "ok", bad                     # Lightning cannot restore it
    age(tmp_path / "vol")                               # the copier died an hour ago
    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    rc, ev = verify(cfg, run / b.name)
    rows = {Path(c["path"]).name: c for c in plan(cfg)["checkpoints"]}
    code, name, err = latest(cfg, run)
    assert rc != 0 and rows[b.name]["state"] != "complete", (rc, rows[b.name])
    assert name == str(run / a.name), (name, err)
    assert rows[a.name]["action"] != "delete", rows[a.name]


def test_a_deepspeed_shard_whose_head_chunk_never_landed_is_not_complete(tmp_path):
    """Real 2-rank DeepSpeed ZeRO-2 saves (bare layout, global_step10 and 20) copied into a volume
    with cp -p, except global_step20's zero_pp_rank_1_mp_rank_00_optim_states.pt, which chunkcopy.py
    was copying when it was SIGKILLed (tail chunk landed, head not). DeepSpeed's load_checkpoint of
    global_step20 fails on rank 1; global_step10 loads on both. The promise: global_step20 is not
    complete, `ckptd latest` names global_step10, keep_last=1 keeps global_step10."""
    import atk
    src = tmp_path / "src" / "run"
    src.mkdir(parents=True)
    atk.ENV["DS_NO_MPU"] = "1"          # plain data parallelism: 2 ranks, ZeRO-2
    try:
        job("ds_tp.py", "save", src, 2, 0, timeout=400)
        age(tmp_path / "src", 7200)
        run = tmp_path / "vol" / "run"
        run.mkdir(parents=True)
        for n in ["latest", "zero_to_fp32.py", "zero_to_torch.py", "global_step10"]:
            subprocess.run(["cp", "-rp", str(src / n), str(run / n)], check=True)
        (run / "global_step20").mkdir()
        for n in ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]:
            subprocess.run(["cp", "-p", str(src / "global_step20" / n), str(run / "global_step20" / n)], check=True)
        shard = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        chunk_copy_killed(src / "global_step20" / shard, run / "global_step20" / shard)
        good, _ = job("ds_tp.py", "load", run, 2, "global_step10", timeout=400)
        bad, _ = job("ds_tp.py", "load", run, 2, "global_step20", timeout=400)
    finally:
        atk.ENV.pop("DS_NO_MPU", None)
    assert good == {"rank0": "ok", "rank1": "ok"}, good
    assert bad["rank1"] != "ok", bad
    age(tmp_path / "vol")
    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    rc, ev = verify(cfg, run / "global_step20")
    rows = {Path(c["path"]).name: c for c in plan(cfg)["checkpoints"]}
    code, name, err = latest(cfg, run)
    assert rc != 0 and rows["global_step20"]["state"] != "complete", (rc, rows["global_step20"])
    assert name == str(run / "global_step10"), (name, err)
    assert rows["global_step10"]["action"] != "delete", rows["global_step10"]


def test_a_trainer_checkpoint_whose_weights_download_died_with_aria2s_control_file_is_not_complete(tmp_path):
    """Real Trainer checkpoints (checkpoint-1, checkpoint-2) restored into a volume: checkpoint-1 and
    every file of checkpoint-2 but model.safetensors copied whole with cp -p; model.safetensors by a
    preallocating downloader (aria2c's default --file-allocation=prealloc: the file is created at its
    full size, chunks land in order) SIGKILLed after the first of four chunks, its control file
    model.safetensors.aria2 left beside it, as aria2c leaves it. The safetensors header is whole and
    its offsets fit the file; most tensors are zeros. The Trainer's loader raises nothing but restores
    weights that are not the saved ones (safetensors.load_file: most tensors differ). The promise:
    checkpoint-2 is not complete, `ckptd latest` names checkpoint-1, keep_last=1 keeps checkpoint-1."""
    from safetensors.torch import load_file
    src = tmp_path / "src" / "out"
    job("trainer_job.py", "train", src, 16, 1, 2)
    age(tmp_path / "src", 7200)
    run = tmp_path / "vol" / "out"
    run.mkdir(parents=True)
    subprocess.run(["cp", "-rp", str(src / "checkpoint-1"), str(run / "checkpoint-1")], check=True)
    (run / "checkpoint-2").mkdir()
    for f in (src / "checkpoint-2").iterdir():
        if f.name != "model.safetensors":
            subprocess.run(["cp", "-p", str(f), str(run / "checkpoint-2" / f.name)], check=True)
    chunk_copy_killed(src / "checkpoint-2" / "model.safetensors", run / "checkpoint-2" / "model.safetensors",
                      nchunks=4, order="0,1,2,3", stop_after=1)
    (run / "checkpoint-2" / "model.safetensors.aria2").write_bytes(b"\x00\x01" + bytes(62))
    saved, got = load_file(src / "checkpoint-2" / "model.safetensors"), load_file(run / "checkpoint-2" / "model.safetensors")
    assert any(not bool((saved[k] == got[k]).all()) for k in saved)     # the loader does not give back the save
    age(tmp_path / "vol", 600)
    cfg = config(tmp_path, tmp_path / "vol", keep_last=1, keep_best=0)
    rc, ev = verify(cfg, run / "checkpoint-2")
    rows = {Path(c["path"]).name: c for c in plan(cfg)["checkpoints"]}
    code, name, err = latest(cfg, run)
    assert rc != 0 and rows["checkpoint-2"]["state"] != "complete", (rc, rows["checkpoint-2"])
    assert name == str(run / "checkpoint-1"), (name, err)
    assert rows["checkpoint-1"]["action"] != "delete", rows["checkpoint-1"]
