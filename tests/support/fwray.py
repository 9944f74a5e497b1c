"""Real Ray Train saves (TorchTrainer on gloo, 2 CPU workers), one of them killed mid-copy, for
tests/completeness/test_ray.py.

``python -m tests.support.fwray OUT RUN [KILL_REPORT]``: `train.report(metrics, checkpoint=...)` four times
from both workers (rank 0 with a checkpoint of two files, `model.pt` and `optim.pt`), RunConfig(storage_path=OUT,
name=RUN), CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss", "min"); the losses are
0.9, 0.5, 0.7, 0.8, so Ray keeps the two best (reports 1 and 2) and the latest (report 3) and deletes report 0.
Ray copies each checkpoint into `OUT/RUN/checkpoint_<date>_<time>/` (ray/train/v2/_internal/execution/
storage.py `persist_current_checkpoint`, file by file) and then registers it in the run's
`checkpoint_manager_snapshot.json` (checkpoint_manager.py `_write_state_to_storage`). With KILL_REPORT the
copy of that report is cut after its first file and the whole job (driver, Ray's processes, workers: one
process group) is SIGKILLed there.

Ray's servers listen on every interface whatever `ray.init` is told: tests/completeness/test_ray.py runs this in a
network namespace whose only interface is the loopback (`unshare -n`).

``python -m tests.support.fwray OUT RUN check``: Ray's own view of what was left: `ray.train.Result.from_path`
(the run's snapshot: which checkpoints it has, the latest, their metrics), each checkpoint's files loaded
with torch, and a restore (the same RunConfig launched again: `ray.train.get_checkpoint()` in the training
function is what Ray resumes from). Prints one JSON line.
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

from tests.support import refuse_in_light_test

LOSSES = (0.9, 0.5, 0.7, 0.8)


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
                num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min"),
        ),
    )


def loop(config: dict) -> None:
    import ray.train
    import torch
    from ray.train.v2._internal.execution import storage

    rank = ray.train.get_context().get_world_rank()
    model = torch.nn.Linear(4, 2)
    copy = storage._pyarrow_fs_copy_files

    def cut_copy(source, destination, **kw):
        """Ray's copy of the killed report: its first file, then the whole job is killed. First it waits
        (bounded) until Ray has registered every earlier report, so that what the job leaves is the same
        each time: reports 1 and 2 listed (0 dropped as the worst), 3 cut short."""
        snapshot = Path(config["run"]) / "checkpoint_manager_snapshot.json"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if json.loads(snapshot.read_text())["current_report_index"] >= config["kill"]:
                    break
            except (OSError, ValueError, KeyError):
                pass  # not written yet, or being rewritten
            time.sleep(0.05)
        else:
            raise TimeoutError("Ray did not register the earlier reports within 120 s")
        first = sorted(os.listdir(source))[0]
        Path(destination).mkdir(parents=True, exist_ok=True)
        with open(os.path.join(source, first), "rb") as f, open(os.path.join(destination, first), "wb") as g:
            g.write(f.read())
            g.flush()
            os.fsync(g.fileno())
        os.killpg(config["pgid"], signal.SIGKILL)  # the driver and whatever of Ray is in its group
        os.kill(os.getpid(), signal.SIGKILL)  # and this worker, if Ray started it in a session of its own:
        # a copy that returned would be reported, and Ray would register the half-copied checkpoint

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
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if ray.train.get_context().get_world_rank() == 0:
        Path(config["answer"]).write_text(os.path.basename(checkpoint.path) if checkpoint else "")
    ray.train.report({})


def start_local_ray(ray) -> None:
    """A local Ray cluster on 127.0.0.1 only (its GCS, raylet and object store), no dashboard."""
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")


def main(out: str, run: str, kill: int | None) -> int:
    import ray

    start_local_ray(ray)
    _trainer(out, run, loop, {"kill": -1 if kill is None else kill, "pgid": os.getpgrp(),
                                        "run": str(Path(out) / run)}).fit()
    ray.shutdown()
    return 0


def check(volume: str, run: str) -> int:
    import ray
    import ray.train
    import torch

    truth: dict[str, object] = {}
    # Ray's restore may write into the run: it is done on a copy, the volume left as the job left it
    out = tempfile.mkdtemp(prefix="rayrestore")
    shutil.copytree(Path(volume) / run, Path(out) / run, symlinks=True)
    run_dir = Path(out) / run
    try:
        result = ray.train.Result.from_path(str(run_dir))
        truth["latest"] = os.path.basename(result.checkpoint.path) if result.checkpoint else None
        truth["best"] = {os.path.basename(c.path): m.get("loss") for c, m in result.best_checkpoints}
    except Exception as exc:  # the framework's own verdict
        truth["result"] = f"{type(exc).__name__}: {exc}"[:300]
    loads = {}
    for d in sorted(p for p in run_dir.iterdir() if p.name.startswith("checkpoint_") and p.is_dir()):
        try:
            torch.load(d / "model.pt", weights_only=True)
            torch.load(d / "optim.pt", weights_only=True)
            loads[d.name] = "loads"
        except Exception as exc:
            loads[d.name] = f"{type(exc).__name__}: {exc}"[:200]
    truth["loads"] = loads
    start_local_ray(ray)
    try:
        answer = Path(out) / "resumed_from"
        _trainer(out, run, resumed, {"answer": str(answer)}).fit()
        truth["restore"] = answer.read_text()
    except Exception as exc:
        truth["restore"] = f"{type(exc).__name__}: {exc}"[:300]
    ray.shutdown()
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(truth))
    return 0


if __name__ == "__main__":
    refuse_in_light_test("Ray Train (tests/support/fwray.py)")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if sys.argv[3:] == ["check"]:
        sys.exit(check(sys.argv[1], sys.argv[2]))
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None))
