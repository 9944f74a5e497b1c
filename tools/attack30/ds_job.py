"""A real DeepSpeed 0.19 job, 2 ranks on gloo (CPU), plain data parallelism (no mpu), bare layout.

Environment: DS_HIDDEN (width, 32), DS_STEPS ("5,10"), DS_STAGE (ZeRO stage, 2),
DS_HOLD_RANK (the rank held), DS_HOLD_PREFIX (the file basename it is held before),
DS_OTHER_FILES (how many files the other rank must have saved at the kill step before the kill).

  python ds_job.py save OUT KILL_STEP   saves the tags of DS_STEPS; at KILL_STEP the held rank blocks
        before writing its DS_HOLD_PREFIX file; once the other rank has written DS_OTHER_FILES files
        of that save (it then waits in DeepSpeed's final barrier), every process is SIGKILLed.
        KILL_STEP 0: no kill.
  python ds_job.py load OUT TAG        a fresh 2-rank job: engine.load_checkpoint(OUT, tag=TAG) and one
        training step; prints {"rank0": "ok"|error, "rank1": ...}.
"""
import json, os, signal, sys, time, socket
from pathlib import Path

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def worker(rank, mode, out, arg, port, resq):
    os.environ.update(ENV)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "CROSS_RANK": "0", "CROSS_SIZE": "1"})
    import logging
    logging.disable(logging.CRITICAL)
    import torch
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm.torch as dct
    import deepspeed.ops as dops
    dct.build_shm_op = lambda: None
    dops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    import datetime
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, timeout=datetime.timedelta(seconds=120))
    stage = int(os.environ.get("DS_STAGE", "2"))
    torch.manual_seed(0)
    h = int(os.environ.get("DS_HIDDEN", "32"))
    model = torch.nn.Sequential(torch.nn.Linear(16, h), torch.nn.ReLU(), torch.nn.Linear(h, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "zero_force_ds_cpu_optimizer": False,
           "steps_per_print": 10**9, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    if mode == "load":
        try:
            engine.load_checkpoint(out, tag=arg)
            x = torch.randn(4, 16)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            res = "ok"
        except BaseException as e:  # noqa
            res = f"{type(e).__name__}: {e}"[:300]
        resq.put((rank, res))
        return
    kill_step = int(arg)
    hold_rank = int(os.environ.get("DS_HOLD_RANK", "1"))
    prefix = os.environ.get("DS_HOLD_PREFIX", "zero_pp_rank_1")
    state = {"step": 0}
    ce = engine.checkpoint_engine
    orig = ce.save

    def save(state_dict, path, *a, **k):
        if state["step"] == kill_step and rank == hold_rank and os.path.basename(str(path)).startswith(prefix):
            Path(out, ".held").write_text(str(path))
            while True:
                time.sleep(3600)
        r = orig(state_dict, path, *a, **k)
        if state["step"] == kill_step and rank != hold_rank:
            with open(Path(out, f".saved_{rank}"), "a") as f:
                f.write(os.path.basename(str(path)) + "\n")
        return r

    ce.save = save
    g = torch.Generator().manual_seed(rank)
    steps = [int(x) for x in os.environ.get("DS_STEPS", "5,10").split(",")]
    for step in range(1, max(steps) + 1):
        x = torch.randn(4, 16, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if step in steps:
            state["step"] = step
            engine.save_checkpoint(out, tag=f"global_step{step}")
    resq.put((rank, "done"))


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def main():
    mode, out, arg = sys.argv[1], sys.argv[2], sys.argv[3]
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, mode, out, arg, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    if mode == "save" and int(arg):
        need = int(os.environ.get("DS_OTHER_FILES", "1"))
        other = 1 - int(os.environ.get("DS_HOLD_RANK", "1"))
        deadline = time.monotonic() + 400
        held, saved = Path(out, ".held"), Path(out, f".saved_{other}")
        while time.monotonic() < deadline:
            if held.exists() and saved.exists() and len(saved.read_text().split()) >= need:
                break
            time.sleep(0.1)
        else:
            for p in procs:
                os.kill(p.pid, signal.SIGKILL)
            raise SystemExit("timed out waiting for the hold")
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        print(json.dumps({"killed": True, "held": held.read_text(), "other_saved": saved.read_text().split()}))
        held.unlink(); saved.unlink()
        return
    import queue
    res = {}
    deadline = time.monotonic() + 300
    while len(res) < 2 and time.monotonic() < deadline:
        try:
            r, v = q.get(timeout=max(0.1, deadline - time.monotonic()))
            res[f"rank{r}"] = v
        except queue.Empty:
            break
    for p in procs:
        p.join(30 if len(res) == 2 else 0.1)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    for r in range(2):
        res.setdefault(f"rank{r}", "no result (blocked or died)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
