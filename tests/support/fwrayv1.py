"""Real Ray Train saves with Ray's older trainers (RAY_TRAIN_V2_ENABLED=0: Train V1 on Tune), one of them
killed mid-copy, for tests/completeness/test_ray_v1.py.

``python -m tests.support.fwrayv1 OUT RUN [KILL_REPORT]``: TorchTrainer on gloo, 2 CPU workers,
`train.report(metrics, checkpoint=...)` five times from both workers (rank 0 with a checkpoint of two files,
`model.pt` and `optim.pt`), RunConfig(storage_path=OUT, name=RUN), CheckpointConfig(num_to_keep=3,
checkpoint_score_attribute="loss", "min"); the losses 0.9, 0.5, 0.7, 0.6, 0.8: with KILL_REPORT 4, Ray keeps
reports 1, 2 and 3 and deletes report 0, and report 4's copy is cut. Ray copies each checkpoint into
the trial's directory `OUT/RUN/TorchTrainer_<id>_00000_0_<date>/checkpoint_00000N/`
(ray/train/_internal/storage.py `persist_current_checkpoint`, `_make_checkpoint_dir_name`), then the
worker's session reports the result (session.py `_TrainSession.report`), the driver appends it to the
trial's result.json (tune/logger/json.py) and registers the checkpoint (tune_controller.py
`_process_trial_save`, checkpoint_manager.py `_CheckpointManager.register_checkpoint`, which deletes the
worst beyond K). With KILL_REPORT the copy of that report is cut after its first file and the whole job
(one process group) SIGKILLed there, once Ray has registered the earlier reports and saved its experiment
state naming them.

``python -m tests.support.fwrayv1 OUT RUN check``: Ray's own view: `Result.from_path` of the trial,
each checkpoint loaded with `Checkpoint.from_directory` + torch, a restore (`TorchTrainer.restore` of
the experiment, `ray.train.get_checkpoint()` in the resumed loop), and what Ray's own `_CheckpointManager`
keeps of the checkpoints that load with other `CheckpointConfig`s (registered in order, with the metrics
result.json pairs with them): the retention a ckptd config should reproduce. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

os.environ["RAY_TRAIN_V2_ENABLED"] = "0"  # before ray is imported: the older trainers

from tests.support import refuse_in_light_test
from tests.support.fwray import start_local_ray

LOSSES = (0.9, 0.5, 0.7, 0.6, 0.8)
KEEP = 3


def _trainer(out: str, run: str, loop, config: dict):
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        loop,
        train_loop_config=config,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(
            storage_path=out, name=run,
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=KEEP, checkpoint_score_attribute="loss", checkpoint_score_order="min"),
        ),
    )


def _registered(experiment: Path, kill: int) -> bool:
    """Whether Ray has done with the reports before `kill`: the last in the trial's result.json, the
    worst of them (report 0) deleted, and an experiment state saved whose checkpoint manager (cloudpickled,
    hex in JSON) holds the last one's path. Read as text, independently of ckptd."""
    want = f"checkpoint_{kill - 1:06d}"
    for trial in experiment.iterdir():
        if not (trial / "result.json").is_file():
            continue
        states = sorted(experiment.glob("experiment_state-*.json"))
        return (f'"checkpoint_dir_name": "{want}"' in (trial / "result.json").read_text()
                and not (trial / "checkpoint_000000").exists()
                and bool(states) and f"{trial.name}/{want}".encode().hex() in states[-1].read_text())
    return False


def loop(config: dict) -> None:
    import ray.train
    import torch
    from ray.train._internal import storage

    rank = ray.train.get_context().get_world_rank()
    model = torch.nn.Linear(4, 2)
    copy = storage._pyarrow_fs_copy_files

    def cut_copy(source, destination, **kw):
        """Ray's copy of the killed report: its first file, then the whole job is killed. First it waits
        (bounded) until Ray has registered every earlier report, so that what the job leaves is the same
        each time."""
        deadline = time.monotonic() + 120
        while not _registered(Path(config["experiment"]), config["kill"]):
            if time.monotonic() > deadline:
                raise TimeoutError("Ray did not register the earlier reports within 120 s")
            time.sleep(0.05)
        first = sorted(os.listdir(source))[0]
        Path(destination).mkdir(parents=True, exist_ok=True)
        with open(os.path.join(source, first), "rb") as f, open(os.path.join(destination, first), "wb") as g:
            g.write(f.read())
            g.flush()
            os.fsync(g.fileno())
        os.killpg(config["pgid"], signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)  # a copy that returned would be reported and registered

    for i, loss in enumerate(LOSSES):
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if rank == 0:
                torch.save(model.state_dict(), os.path.join(tmp, "model.pt"))
                torch.save({"step": i}, os.path.join(tmp, "optim.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
                storage._pyarrow_fs_copy_files = cut_copy if i == config["kill"] else copy
            ray.train.report({"loss": loss, "report": i}, checkpoint=checkpoint)


def resumed(config: dict) -> None:
    """The restored loop: its config is the first run's (Ray refuses another param_space), the answer's
    path comes through the environment Ray's workers inherit."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if ray.train.get_context().get_world_rank() == 0:
        Path(os.environ["FWRAYV1_ANSWER"]).write_text(os.path.basename(checkpoint.path) if checkpoint else "")
    ray.train.report({})


def _ray_keeps(trial: Path, loadable: list[str]) -> dict[str, list[str]]:
    """What Ray's `_CheckpointManager` (checkpoint_manager.py `register_checkpoint`) keeps of `loadable`,
    registered in order on a copy, for each CheckpointConfig named by its key."""
    import ray.train
    from ray.train._internal.checkpoint_manager import _CheckpointManager
    from ray.train._internal.session import _TrainingResult

    records = {}
    for line in (trial / "result.json").read_text().splitlines():
        result = json.loads(line)
        if result.get("checkpoint_dir_name"):
            records[result["checkpoint_dir_name"]] = result
    configs = {"best1": dict(num_to_keep=1, checkpoint_score_attribute="loss", checkpoint_score_order="min"),
               "best2": dict(num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min"),
               "newest2": dict(num_to_keep=2)}
    kept = {}
    for key, config in configs.items():
        copy = Path(tempfile.mkdtemp(prefix="raykeeps")) / trial.name
        shutil.copytree(trial, copy)
        manager = _CheckpointManager(ray.train.CheckpointConfig(**config))
        for name in loadable:
            manager.register_checkpoint(_TrainingResult(
                checkpoint=ray.train.Checkpoint.from_directory(str(copy / name)), metrics=records[name]))
        kept[key] = sorted(p.name for p in copy.iterdir() if p.name in loadable)
        shutil.rmtree(copy.parent, ignore_errors=True)
    return kept



def main(out: str, run: str, kill: int | None) -> int:
    import ray

    start_local_ray(ray)
    _trainer(out, run, loop, {"kill": -1 if kill is None else kill, "pgid": os.getpgrp(),
                              "experiment": str(Path(out) / run)}).fit()
    ray.shutdown()
    return 0


def check(volume: str, run: str) -> int:
    import ray
    import ray.train
    import torch
    from ray.train.torch import TorchTrainer

    truth: dict[str, object] = {}
    out = tempfile.mkdtemp(prefix="rayv1restore")  # Ray's restore writes into the experiment: a copy
    shutil.copytree(Path(volume) / run, Path(out) / run, symlinks=True)
    trial = next(p for p in (Path(out) / run).iterdir() if p.is_dir() and (p / "params.json").exists())
    truth["trial"] = trial.name
    try:
        result = ray.train.Result.from_path(str(trial))
        truth["result_checkpoint"] = os.path.basename(result.checkpoint.path) if result.checkpoint else None
        truth["metrics"] = {os.path.basename(c.path): m.get("loss") for c, m in result.best_checkpoints}
    except Exception as exc:
        truth["result"] = f"{type(exc).__name__}: {exc}"[:300]
    loads = {}
    for d in sorted(p for p in trial.iterdir() if p.name.startswith("checkpoint_") and p.is_dir()):
        try:
            with ray.train.Checkpoint.from_directory(str(d)).as_directory() as local:
                torch.load(Path(local) / "model.pt", weights_only=True)
                torch.load(Path(local) / "optim.pt", weights_only=True)
            loads[d.name] = "loads"
        except Exception as exc:
            loads[d.name] = f"{type(exc).__name__}: {exc}"[:200]
    truth["loads"] = loads
    truth["ray_keeps"] = _ray_keeps(trial, [n for n, v in loads.items() if v == "loads"])
    answer = Path(out) / "resumed_from"
    os.environ["FWRAYV1_ANSWER"] = str(answer)
    start_local_ray(ray)
    try:
        TorchTrainer.restore(str(Path(out) / run), train_loop_per_worker=resumed).fit()
        truth["restore"] = answer.read_text()
    except Exception as exc:
        truth["restore"] = f"{type(exc).__name__}: {exc}"[:300]
    ray.shutdown()
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(truth))
    return 0


if __name__ == "__main__":
    refuse_in_light_test("Ray Train V1 (tests/support/fwrayv1.py)")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if sys.argv[3:] == ["check"]:
        sys.exit(check(sys.argv[1], sys.argv[2]))
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None))
