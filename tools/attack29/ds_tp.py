"""Environment: DS_NO_MPU=1 (plain data parallelism), DS_HIDDEN (width, 32), DS_STEPS ("10,20"),
DS_KILL_PREFIX (the file rank 1 is held before, "mp_rank_01").

A real DeepSpeed job, 2 ranks on gloo (CPU), with a Megatron-style mpu: tensor-parallel 2,
data-parallel 1 (what Megatron-DeepSpeed passes as deepspeed.initialize(mpu=...)).

  python ds_tp.py save OUT STAGE KILL_STEP   saves global_step10 and global_step20 (bare layout);
        at KILL_STEP rank 1 is held just before it writes its mp_rank_01 model states and the
        process group is SIGKILLed once rank 0 has written `latest` (rank 0 then waits in the
        final barrier). KILL_STEP 0: no kill.
  python ds_tp.py load OUT STAGE TAG       a fresh 2-rank job: engine.load_checkpoint(OUT, tag=TAG);
        prints one JSON line {"rank0": "ok"|error, "rank1": ...}.
"""
import json, os, signal, sys, time, socket
from pathlib import Path

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


class MPU:
    def __init__(self, dist, rank, world):
        self.rank, self.world = rank, world
        self.mp_group = dist.new_group(list(range(world)))
        self.dp_groups = [dist.new_group([r]) for r in range(world)]

    def get_model_parallel_rank(self): return self.rank
    def get_model_parallel_world_size(self): return self.world
    def get_model_parallel_group(self): return self.mp_group
    def get_data_parallel_rank(self): return 0
    def get_data_parallel_world_size(self): return 1
    def get_data_parallel_group(self): return self.dp_groups[self.rank]
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group


def worker(rank, mode, out, stage, arg, port, resq):
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
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, timeout=datetime.timedelta(seconds=60))
    import torch.distributed as dist
    mpu = None if os.environ.get("DS_NO_MPU") == "1" else MPU(dist, rank, 2)
    torch.manual_seed(0)
    h = int(os.environ.get("DS_HIDDEN", "32"))
    model = torch.nn.Sequential(torch.nn.Linear(16, h), torch.nn.ReLU(), torch.nn.Linear(h, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "zero_force_ds_cpu_optimizer": False,
           "steps_per_print": 10**9, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, mpu=mpu)
    if mode == "load":
        try:
            engine.load_checkpoint(out, tag=arg)
            x = torch.randn(4, 16)                      # a resume: one more step with what was restored
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            res = "ok"
        except BaseException as e:  # noqa
            res = f"{type(e).__name__}: {e}"[:300]
        resq.put((rank, res))
        return
    kill_step = int(arg)
    state = {"step": 0}
    ce = engine.checkpoint_engine
    orig = ce.save

    def save(state_dict, path, *a, **k):
        if rank == 1 and state["step"] == kill_step and os.path.basename(str(path)).startswith(os.environ.get("DS_KILL_PREFIX", "mp_rank_01")):
            Path(out, ".rank1_held").write_text(str(path))
            while True:
                time.sleep(3600)
        return orig(state_dict, path, *a, **k)

    ce.save = save
    g = torch.Generator().manual_seed(rank)
    steps = [int(x) for x in os.environ.get("DS_STEPS", "10,20").split(",")]
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
    mode, out, stage, arg = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, mode, out, stage, arg, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    if mode == "save" and int(arg):
        t_start = time.time() - 1
        deadline = time.monotonic() + 300
        latest = Path(out, "latest")
        while time.monotonic() < deadline:
            if Path(out, ".rank1_held").exists() and latest.exists() and latest.stat().st_mtime >= t_start and latest.read_text().strip() == f"global_step{arg}":
                break
            time.sleep(0.1)
        else:
            raise SystemExit("timed out waiting for the hold")
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        Path(out, ".rank1_held").unlink()
        print(json.dumps({"killed": True}))
        return
    import queue
    res = {}
    deadline = time.monotonic() + 240
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
