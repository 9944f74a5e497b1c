"""The frameworks' own loaders, run over damaged checkpoints: the ground truth for tests/completeness/test_damaged_saves.py.

``python -m tests.support.fwattack FRAMEWORK SPEC.json`` loads every checkpoint SPEC lists
(``[{"key": ..., "path": ..., ...}]``) with FRAMEWORK's own loader, in this one process, and prints
one JSON line ``{key: verdict}``. A verdict is ``"full"`` (the loader ran and restored everything the
save wrote: the values, the step, the optimizer and scheduler, the RNG), ``"partial: <what was
silently skipped>"`` (no error, but a resume would not continue where the save left off), or
``"fails: <exception>"``.

FRAMEWORK is ``dcp`` (``dcp.load``, one process), ``orbax`` (``CheckpointManager.all_steps`` +
``restore``, with the writer's options), ``accelerate`` (``Accelerator.load_state``), ``trainer``
(``Trainer.train(resume_from_checkpoint=...)`` for two more steps, in a scratch directory) or
``lightning`` (``Trainer.fit(ckpt_path=...)``). The models are fwgen's/fwweights' (fwgen imports no
framework at import time).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

from tests.support import child_pythonpath, fwgen, refuse_in_light_test


def _err(exc: BaseException) -> str:
    return "fails: " + fwgen._error(exc)


def _dcp(item: dict) -> str:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    template = fwgen._dcp_state(0)  # right shapes, wrong values: dcp.load fills them in place
    try:
        dcp.load(template, checkpoint_id=item["path"])
    except (Exception, CheckpointException) as exc:
        return _err(exc)
    expected = fwgen._dcp_state(item["step"])
    if not all(torch.equal(template["model"][k], expected["model"][k]) for k in expected["model"]):
        return "partial: wrong values"
    if int(template["train_state"]["step"]) != item["step"]:
        return "partial: wrong step"
    return "full"


def _orbax(item: dict) -> str:
    import orbax.checkpoint as ocp

    state = fwgen._orbax_state()
    options = fwgen._orbax_options(ocp, item.get("mode"), read_only=True, **item.get("options", {}))
    try:
        mngr = ocp.CheckpointManager(item["run"], options=options)
        steps = list(mngr.all_steps())
        if item["step"] not in steps:
            return f"fails: not listed by all_steps() ({steps})"
        restored = mngr.restore(item["step"], args=ocp.args.StandardRestore(state))
        mngr.close()
    except Exception as exc:
        return _err(exc)
    if float(restored["params"]["w"].sum()) != 120.0:
        return "partial: wrong values"
    return "full"


def _accelerate(item: dict) -> str:
    import torch

    parts = fwgen._acc_setup()
    _, _, optimizer, _, scheduler = parts
    torch.manual_seed(999)
    sentinel = torch.get_rng_state()
    before_sched = scheduler.state_dict()["last_epoch"]
    try:
        parts[0].load_state(item["path"])
    except Exception as exc:
        return _err(exc)
    skipped = []
    if torch.equal(torch.get_rng_state(), sentinel):
        skipped.append("RNG not restored")
    if not optimizer.state_dict()["state"]:
        skipped.append("optimizer state empty")
    if scheduler.state_dict()["last_epoch"] == before_sched:
        skipped.append("scheduler not restored")
    return "partial: " + "; ".join(skipped) if skipped else "full"


def _trainer(item: dict) -> str:
    import logging

    import torch
    from transformers import TrainerCallback

    loaded: dict[str, bool] = {"optimizer": False, "scheduler": False}
    # the Trainer's default scheduler is a LambdaLR (get_linear_schedule_with_warmup), which overrides
    # LRScheduler.load_state_dict (torch/optim/lr_scheduler.py)
    sched_cls = torch.optim.lr_scheduler.LambdaLR
    opt_load, sched_load = torch.optim.Optimizer.load_state_dict, sched_cls.load_state_dict

    def opt_hook(self, sd):
        # accelerate's AcceleratedOptimizer reloads the fresh (stateless) dict for device placement
        # (accelerate/optimizer.py __init__): only a dict with Adam's moments is the checkpoint's
        loaded["optimizer"] = loaded["optimizer"] or bool(sd.get("state"))
        return opt_load(self, sd)

    def sched_hook(self, sd):
        loaded["scheduler"] = True
        return sched_load(self, sd)

    messages: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            if "RNG file" in record.getMessage():
                messages.append(record.getMessage())

    class CountSteps(TrainerCallback):
        steps = 0

        def on_step_end(self, args, state, control, **kw):
            CountSteps.steps += 1

    handler = Capture()
    logging.getLogger("transformers.trainer").addHandler(handler)
    torch.optim.Optimizer.load_state_dict = opt_hook
    sched_cls.load_state_dict = sched_hook
    CountSteps.steps = 0
    try:
        with tempfile.TemporaryDirectory() as scratch:
            trainer = fwgen._trainer_parts(Path(scratch), item["step"] + 2, save_strategy="no", eval_strategy="no",
                                           load_best_model_at_end=False, metric_for_best_model=None, ddp_backend=None)
            trainer.add_callback(CountSteps())
            try:
                trainer.train(resume_from_checkpoint=item["path"])
            except Exception as exc:
                return _err(exc)
            started_at = trainer.state.global_step - CountSteps.steps
    finally:
        torch.optim.Optimizer.load_state_dict = opt_load
        sched_cls.load_state_dict = sched_load
        logging.getLogger("transformers.trainer").removeHandler(handler)
    skipped = []
    if started_at != item["step"]:
        skipped.append(f"resumed at step {started_at}, not {item['step']}")
    if not item.get("save_only_model"):
        skipped += [f"{what} not restored" for what, ok in loaded.items() if not ok]
        skipped += messages[:1]
    return "partial: " + "; ".join(skipped) if skipped else "full"


def _lightning(item: dict) -> str:
    with tempfile.TemporaryDirectory() as scratch:
        try:
            trainer = fwgen._lightning_fit(Path(scratch), "team-a/run-default", len(fwgen.VAL_LOSSES) + 1,
                                           ckpt_path=item["path"], root=Path(scratch))
        except Exception as exc:
            return _err(exc)
    return "full" if trainer.current_epoch == len(fwgen.VAL_LOSSES) + 1 else f"partial: epoch {trainer.current_epoch}"


_DS_ENGINE: list = []


def _deepspeed(item: dict) -> str:
    """``engine.load_checkpoint(save_dir)`` as transformers' ``deepspeed_load_checkpoint`` calls it
    (integrations/deepspeed.py: tag=None, so DeepSpeed reads ``latest``; a None load path is its
    "failed to resume" error), on one rank with dsgen's model and config (ZeRO-2, fp32)."""
    import torch

    if not _DS_ENGINE:
        import deepspeed

        from tests.support import dsgen

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", LOCAL_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(fwgen._free_port()), DS_ACCELERATOR="cpu")
        torch.set_num_threads(1)
        dsgen._quiet_deepspeed()
        dsgen._skip_shm_build()
        deepspeed.init_distributed("gloo", auto_mpi_discovery=False)
        torch.manual_seed(1234)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 2}, "zero_force_ds_cpu_optimizer": False,
                  "bf16": {"enabled": False}, "steps_per_print": 1_000_000, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        dsgen._quiet_deepspeed()
        _DS_ENGINE.append(engine)
    engine = _DS_ENGINE[0]
    try:
        load_path, _ = engine.load_checkpoint(item["path"], load_optimizer_states=True, load_lr_scheduler_states=True)
    except Exception as exc:
        return _err(exc)
    if load_path is None:
        return "fails: load_checkpoint returned None (transformers: [deepspeed] failed to resume from checkpoint)"
    if engine.global_steps != item["step"]:
        return f"partial: global_steps {engine.global_steps}, not {item['step']}"
    return "full"


LOADERS = {"deepspeed": _deepspeed, "dcp": _dcp, "orbax": _orbax, "accelerate": _accelerate, "trainer": _trainer, "lightning": _lightning}


def main(framework: str, spec: str) -> int:
    for k, v in fwgen._CHILD_ENV.items():
        os.environ.setdefault(k, v)
    if framework == "write-lightning":  # SPEC is the output directory: two epochs of fwgen's default run
        fwgen._lightning_fit(Path(spec), "team-a/run-default", 2)
        return 0
    items = json.loads(Path(spec).read_text())
    out = {}
    for item in items:
        try:
            out[item["key"]] = LOADERS[framework](item)
        except BaseException as exc:  # a loader bug is a verdict too, never a silent pass
            traceback.print_exc()
            out[item["key"]] = "error in the loader: " + fwgen._error(exc)
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


def write_lightning(out: Path, timeout: float = 300) -> Path:
    """Lightning's ModelCheckpoint (save_top_k=-1, save_last=True), two epochs, in a fresh process: the run."""
    import subprocess

    env = {**os.environ, **fwgen._CHILD_ENV, "PYTHONPATH": child_pythonpath()}
    proc = subprocess.run([sys.executable, "-m", "tests.support.fwattack", "write-lightning", str(out)], capture_output=True, text=True,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"fwattack write-lightning exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return out / "team-a" / "run-default"


def load(framework: str, items: list[dict], workdir: Path, timeout: float = 600) -> dict[str, str]:
    """Run this script in a fresh process; {key: verdict}."""
    import subprocess

    spec = workdir / f"{framework}-spec.json"
    spec.write_text(json.dumps(items))
    env = {**os.environ, **fwgen._CHILD_ENV, "PYTHONPATH": child_pythonpath()}
    proc = subprocess.run([sys.executable, "-m", "tests.support.fwattack", framework, str(spec)], capture_output=True, text=True,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"fwattack {framework} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    refuse_in_light_test("a framework's own loader (tests/support/fwattack.py)")
    sys.exit(main(sys.argv[1], sys.argv[2]))
