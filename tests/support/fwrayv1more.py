"""A Ray Train V1 run (tests/support/fwrayv1.py's) restored and carried on, for
tests/completeness/test_ray_v1_resume.py.

``python -m tests.support.fwrayv1more EXPERIMENT N``: `TorchTrainer.restore(EXPERIMENT)` (in place: the caller
passes a copy) with a loop that reports N more checkpoints (rank 0, model.pt and optim.pt, losses 0.1, 0.05, ...:
each better than any before, so Ray's `_CheckpointManager` drops the worst of those it holds at each one,
checkpoint_manager.py `register_checkpoint` -> storage.py `_delete_fs_path`). Prints one JSON line: the
checkpoint the restored loop got (`ray.train.get_checkpoint()`), the error `fit()` raised (None), and the
checkpoint directories of the trial afterwards.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["RAY_TRAIN_V2_ENABLED"] = "0"  # before ray is imported: the older trainers

from tests.support import refuse_in_light_test


def more(config: dict) -> None:
    import ray.train
    import torch

    checkpoint = ray.train.get_checkpoint()
    rank = ray.train.get_context().get_world_rank()
    if rank == 0:
        Path(os.environ["FWRAYV1_ANSWER"]).write_text(os.path.basename(checkpoint.path) if checkpoint else "")
    for i in range(int(os.environ["FWRAYV1_MORE"])):
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            if rank == 0:
                torch.save(torch.nn.Linear(4, 2).state_dict(), os.path.join(tmp, "model.pt"))
                torch.save({"step": 100 + i}, os.path.join(tmp, "optim.pt"))
                ckpt = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report({"loss": 0.1 / (i + 1), "report": 100 + i}, checkpoint=ckpt)


def main(experiment: str, n: int) -> int:
    import ray
    from ray.train.torch import TorchTrainer

    answer = Path(tempfile.mkdtemp(prefix="rayv1more")) / "resumed_from"
    os.environ["FWRAYV1_ANSWER"] = str(answer)
    os.environ["FWRAYV1_MORE"] = str(n)
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    out: dict[str, object] = {"error": None}
    try:
        TorchTrainer.restore(experiment, train_loop_per_worker=more).fit()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[-600:]
    ray.shutdown()
    out["resumed_from"] = answer.read_text() if answer.exists() else None
    trial = next(p for p in Path(experiment).iterdir() if (p / "params.json").exists())
    out["left"] = sorted(p.name for p in trial.iterdir() if p.name.startswith("checkpoint_"))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    refuse_in_light_test("Ray Train V1 (tests/support/fwrayv1more.py)")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
