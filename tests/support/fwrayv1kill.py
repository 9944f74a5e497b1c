"""Ray Train V1 runs (RAY_TRAIN_V2_ENABLED=0) killed at points of Ray's registration other than the copy,
for tests/completeness/test_ray_v1_resume.py.

``python -m tests.support.fwrayv1kill OUT RUN after_delete NAME``: TorchTrainer on gloo, 2 CPU workers,
CheckpointConfig(num_to_keep=2, "loss", "min"), reports with losses 0.5, 0.6, 0.9, 0.8 (rank 0 with a
checkpoint; each loss reported as "eval": {"loss": ...} too). Report 3 waits (bounded) until the experiment state on the volume holds report 2 (Ray keeps
reports 0, 1 and 2, the latest). Registering report 3 makes Ray's `_CheckpointManager.register_checkpoint`
(checkpoint_manager.py) drop report 2, the experiment state's latest so far, and delete its directory
(storage.py `_delete_fs_path`), before the controller saves the experiment state naming report 3
(tune_controller.py `_process_trial_save` -> `on_trial_checkpoint`). The driver's `_delete_fs_path` is wrapped: once it has
deleted NAME the whole job is SIGKILLed, so the state on the volume still names the deleted directory as
the latest.

``python -m tests.support.fwrayv1kill OUT RUN restore``: `TorchTrainer.restore` of a copy, the checkpoint
the resumed loop gets, or the error. One JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ["RAY_TRAIN_V2_ENABLED"] = "0"  # before ray is imported: the older trainers

from tests.support import refuse_in_light_test
from tests.support.fwray import start_local_ray

LOSSES = (0.5, 0.6, 0.9, 0.8)


def _state_holds(experiment: Path, name: str) -> bool:
    """Whether the newest experiment state's checkpoint managers (cloudpickled, hex in JSON) hold `name`."""
    states = sorted(experiment.glob("experiment_state-*.json"))
    return bool(states) and f"/{name}".encode().hex() in states[-1].read_text()


def loop(config: dict) -> None:
    import ray.train
    import torch

    rank = ray.train.get_context().get_world_rank()
    for i, loss in enumerate(LOSSES):
        deadline = time.monotonic() + 120
        while i == len(LOSSES) - 1 and not _state_holds(Path(config["experiment"]), f"checkpoint_{i - 1:06d}"):
            if time.monotonic() > deadline:
                raise TimeoutError("Ray did not save an experiment state holding the previous report in 120 s")
            time.sleep(0.05)
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if rank == 0:
                torch.save(torch.nn.Linear(4, 2).state_dict(), os.path.join(tmp, "model.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report({"loss": loss, "report": i, "eval": {"loss": loss}}, checkpoint=checkpoint)


def resumed(config: dict) -> None:
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if ray.train.get_context().get_world_rank() == 0:
        Path(os.environ["FWRAYV1_ANSWER"]).write_text(os.path.basename(checkpoint.path) if checkpoint else "")
    ray.train.report({})



def main(out: str, run: str, name: str) -> int:
    import ray
    import ray.train
    from ray.train._internal import checkpoint_manager
    from ray.train.torch import TorchConfig, TorchTrainer

    delete = checkpoint_manager._delete_fs_path

    def delete_then_die(fs, fs_path):
        delete(fs=fs, fs_path=fs_path)
        if os.path.basename(fs_path) == name:
            os.killpg(os.getpgrp(), signal.SIGKILL)

    checkpoint_manager._delete_fs_path = delete_then_die
    start_local_ray(ray)
    TorchTrainer(
        loop, train_loop_config={"experiment": str(Path(out) / run)}, torch_config=TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(storage_path=out, name=run, checkpoint_config=ray.train.CheckpointConfig(
            num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min")),
    ).fit()
    return 0


def restore(volume: str, run: str) -> int:
    import ray
    from ray.train.torch import TorchTrainer

    out = tempfile.mkdtemp(prefix="rayv1kill")
    shutil.copytree(Path(volume) / run, Path(out) / run, symlinks=True)
    answer = Path(out) / "resumed_from"
    os.environ["FWRAYV1_ANSWER"] = str(answer)
    start_local_ray(ray)
    truth: dict[str, object] = {}
    try:
        TorchTrainer.restore(str(Path(out) / run), train_loop_per_worker=resumed).fit()
        truth["restore"] = answer.read_text() if answer.exists() else None
    except Exception as exc:
        truth["restore"] = None
        text = "".join(traceback.format_exception(exc))
        text += "".join(p.read_text(errors="replace") for p in Path(out, run).rglob("error.txt"))
        truth["error"] = f"{type(exc).__name__}: {exc}"[:300]
        # trainable.py `Trainable.restore`: the trial's error, chained to fit()'s or in its error.txt
        truth["checkpoint_gone"] = "Could not recover from checkpoint as it does not exist on storage" in text
    ray.shutdown()
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(truth))
    return 0


if __name__ == "__main__":
    refuse_in_light_test("Ray Train V1 (tests/support/fwrayv1kill.py)")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if sys.argv[3] == "restore":
        sys.exit(restore(sys.argv[1], sys.argv[2]))
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[4]))
