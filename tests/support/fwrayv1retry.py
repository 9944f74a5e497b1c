"""A Ray Train V1 run (RAY_TRAIN_V2_ENABLED=0) whose rank-0 worker is SIGKILLed in a checkpoint's copy and
retried by Ray (FailureConfig(max_failures=1)), for tests/completeness/test_ray_v1_resume.py.

``python -m tests.support.fwrayv1retry OUT``: TorchTrainer on gloo, 2 CPU workers, reports 0-3 (rank 0 with
model.pt and optim.pt, loss 1/(i+1)); report 2's copy is cut after its first file and the worker killed,
once. Ray restarts the workers from checkpoint_000001 (ray.train.get_checkpoint()), the loop goes on from
there, and the run finishes. On restart the trial's result.json is copied down from the storage over the
driver's own (tune/logger/logger.py `_restore_from_remote`), so it may lack the results reported before
the failure, which the experiment state's checkpoint manager still holds. Prints one JSON line: the
Result's checkpoint and {checkpoint: loss} of its best_checkpoints (the manager's own records).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile

os.environ["RAY_TRAIN_V2_ENABLED"] = "0"  # before ray is imported: the older trainers

from tests.support import refuse_in_light_test


def loop(config: dict) -> None:
    import ray.train
    import torch
    from ray.train._internal import storage

    rank = ray.train.get_context().get_world_rank()
    ckpt = ray.train.get_checkpoint()
    start = torch.load(os.path.join(ckpt.path, "optim.pt"))["step"] + 1 if ckpt else 0
    copy = storage._pyarrow_fs_copy_files

    def cut(source, destination, **kw):
        first = sorted(os.listdir(source))[0]
        os.makedirs(destination, exist_ok=True)
        with open(os.path.join(source, first), "rb") as f, open(os.path.join(destination, first), "wb") as g:
            g.write(f.read())
        open(config["marker"], "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

    for i in range(start, 4):
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if rank == 0:
                torch.save({"w": i}, os.path.join(tmp, "model.pt"))
                torch.save({"step": i}, os.path.join(tmp, "optim.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
                once = i == 2 and not os.path.exists(config["marker"])
                storage._pyarrow_fs_copy_files = cut if once else copy
            ray.train.report({"loss": 1.0 / (i + 1), "report": i}, checkpoint=checkpoint)


def main(out: str) -> int:
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    result = TorchTrainer(
        loop, train_loop_config={"marker": os.path.join(out, "killed-once")}, torch_config=TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(storage_path=out, name="run",
                                       failure_config=ray.train.FailureConfig(max_failures=1)),
    ).fit()
    ray.shutdown()
    print(json.dumps({"checkpoint": os.path.basename(result.checkpoint.path), "error": str(result.error),
                      "losses": {os.path.basename(c.path): m["loss"] for c, m in result.best_checkpoints}}))
    return 0


if __name__ == "__main__":
    refuse_in_light_test("Ray Train V1 (tests/support/fwrayv1retry.py)")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    sys.exit(main(sys.argv[1]))
