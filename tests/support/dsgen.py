"""Generate REAL DeepSpeed checkpoints on the CPU for ckptd's tests.

A tiny MLP is trained for a few steps by a genuine multi-process DeepSpeed
job (``torch.multiprocessing.spawn``, gloo, ``DS_ACCELERATOR=cpu``) and saved
with ``engine.save_checkpoint`` at each requested step.  See DSGEN_NOTES.md
for what ends up on disk and for measured timings.

Test-side use (this module imports neither torch nor deepspeed at import time;
the DeepSpeed job always runs in a fresh ``python -m tests.support.dsgen ...``
subprocess, killed as a process group on timeout)::

    from tests.support.dsgen import generate, start
    info = generate(tmp_path, world_size=2, stage=2, layout="hf", steps=(10, 20))

    run = start(tmp_path, stage=2, layout="bare", steps=(10, 20),
                slow_rank=1, slow_seconds=30)      # slow save at the last step
    ev = run.wait_for("slow_rank_waiting", timeout=120)
    ...inspect the in-flight checkpoint...
    run.release()                                  # end the hold early
    info = run.wait()

CLI::

    python -m tests.support.dsgen OUT --world-size 2 --stage 3 --bf16 --layout bare --steps 10 20
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support import child_pythonpath, refuse_in_light_test

__all__ = [
    "EVENT_PREFIX",
    "SLOW_MARKER",
    "DsgenError",
    "Run",
    "generate",
    "load_optim_shard",
    "load_world_sizes",
    "optim_safe_globals",
    "start",
]

SLOW_MARKER = ".slow_rank_waiting"
EVENT_PREFIX = "@@dsgen "

# Environment for the DeepSpeed subprocess.  DS_ACCELERATOR=cpu stops the
# accelerator auto-detection; the thread caps keep 2-4 ranks from
# oversubscribing small CI boxes (measured: matters a lot on 2 cores).
_CHILD_ENV = {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "PYTHONWARNINGS": "ignore",
}


class DsgenError(RuntimeError):
    """The DeepSpeed subprocess failed or timed out; ``output`` holds its log."""

    def __init__(self, msg: str, output: str = ""):
        super().__init__(f"{msg}\n--- dsgen output (tail) ---\n{output[-6000:]}")
        self.output = output


# --------------------------------------------------------------------------
# Parent side (no torch / deepspeed imports)
# --------------------------------------------------------------------------


def _norm_losses(steps: Sequence[int], eval_losses) -> dict[int, float] | None:
    if eval_losses is None:
        return None
    if isinstance(eval_losses, Mapping):
        out = {int(k): float(v) for k, v in eval_losses.items()}
    else:
        vals = list(eval_losses)
        if len(vals) != len(steps):
            raise ValueError(f"eval_losses has {len(vals)} values for {len(steps)} steps")
        out = {int(s): float(v) for s, v in zip(steps, vals, strict=True)}
    missing = [s for s in steps if s not in out]
    if missing:
        raise ValueError(f"eval_losses lacks steps {missing}")
    return out


def _cli_args(
    out_dir,
    *,
    world_size,
    stage,
    bf16,
    offload,
    layout,
    steps,
    eval_losses,
    slow_rank,
    slow_seconds,
    slow_step,
    train_steps_per_save,
    seed,
    timeout=300,
    config_as_path=False,
    grad_accum_fp32=False,
    trainer_weights=False,
    hidden=32,
    layers=0,
    save_gap=0.0,
) -> list[str]:
    if not 1 <= world_size <= 8:
        raise ValueError("world_size must be 1..8 (2..4 intended)")
    if stage not in (0, 1, 2, 3):
        raise ValueError("stage must be 0, 1, 2 or 3")
    if layout not in ("hf", "bare"):
        raise ValueError("layout must be 'hf' or 'bare'")
    steps = [int(s) for s in steps]
    if not steps or sorted(set(steps)) != steps or steps[0] <= 0:
        raise ValueError("steps must be strictly increasing positive ints")
    if train_steps_per_save is not None and train_steps_per_save < 1:
        raise ValueError("train_steps_per_save must be >= 1 (or None)")
    if slow_rank is not None and not 0 <= slow_rank < world_size:
        raise ValueError("slow_rank out of range")
    if trainer_weights and layout != "hf":
        raise ValueError("trainer_weights: the Trainer layout only")
    if hidden < 1 or layers < 0:
        raise ValueError("hidden must be >= 1 and layers >= 0")
    args = [
        str(out_dir),
        "--world-size",
        str(world_size),
        "--stage",
        str(stage),
        "--layout",
        layout,
        "--steps",
        *map(str, steps),
        "--seed",
        str(seed),
        "--timeout",
        repr(float(timeout)),
    ]
    if train_steps_per_save is not None:
        args += ["--train-steps-per-save", str(train_steps_per_save)]
    if trainer_weights:
        args.append("--trainer-weights")
    if (hidden, layers) != (32, 0):
        args += ["--hidden", str(hidden), "--layers", str(layers)]
    if save_gap:
        args += ["--save-gap", repr(float(save_gap))]
    if bf16:
        args.append("--bf16")
    if offload:
        args.append("--offload")
    if config_as_path:
        args.append("--config-path")
    if grad_accum_fp32:
        args.append("--grad-accum-fp32")
    losses = _norm_losses(steps, eval_losses)
    if losses is not None:
        args += ["--eval-losses", *(repr(losses[s]) for s in steps)]
    if slow_rank is not None:
        args += ["--slow-rank", str(slow_rank), "--slow-seconds", repr(float(slow_seconds))]
        if slow_step is not None:
            args += ["--slow-step", str(int(slow_step))]
    return args


class Run:
    """A running ``python -m tests.support.dsgen`` subprocess (see :func:`start`)."""

    def __init__(self, out_dir: Path, argv: list[str], timeout: float, env: Mapping[str, str] | None):
        self.out_dir = out_dir
        self.timeout = timeout
        self.events: list[dict[str, Any]] = []
        self._lines: collections.deque[str] = collections.deque(maxlen=2000)
        self._cond = threading.Condition()
        self._eof = False
        self._t0 = time.monotonic()
        child_env = dict(os.environ)
        child_env.update(_CHILD_ENV)
        child_env["PYTHONPATH"] = child_pythonpath()
        if env:
            child_env.update(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.dsgen", *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
            text=True,
            errors="replace",
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, name="dsgen-reader", daemon=True)
        self._reader.start()

    # -- output handling ---------------------------------------------------
    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                if line.startswith(EVENT_PREFIX):
                    try:
                        ev = json.loads(line[len(EVENT_PREFIX) :])
                    except ValueError:
                        self._lines.append(line)
                        continue
                    ev["t"] = time.monotonic() - self._t0
                    self.events.append(ev)
                    self._cond.notify_all()
                else:
                    self._lines.append(line)
        self.proc.stdout.close()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "".join(self._lines)

    def wait_for(self, event: str, timeout: float = 120.0, **match) -> dict[str, Any]:
        """Block until the child reports ``event`` (optionally with matching fields)."""

        def find():
            for ev in self.events:
                if ev.get("event") == event and all(ev.get(k) == v for k, v in match.items()):
                    return ev
            return None

        with self._cond:
            ok = self._cond.wait_for(lambda: find() is not None or self._eof, timeout)
            ev = find()
        if ev is None:
            why = "child exited" if ok else f"timeout after {timeout}s"
            raise DsgenError(f"event {event!r} {match} not seen ({why})", self.output)
        return ev

    def release(self) -> None:
        """End the slow rank's hold now (SIGUSR1 to that rank's pid).

        Harmless if the hold already ended: the ranks ignore a stray SIGUSR1."""
        ev = self.wait_for("slow_rank_waiting", timeout=0)
        with self._cond:
            if any(e.get("event") == "slow_rank_done" for e in self.events) or self.proc.poll() is not None:
                return
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(ev["pid"]), signal.SIGUSR1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # our own session: CLI + ranks
        self.proc.wait()
        self._reader.join(30)  # EOF once every rank is gone

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the run to finish; return metadata (see :func:`generate`)."""
        remaining = self.timeout - (time.monotonic() - self._t0) if timeout is None else timeout
        try:
            rc = self.proc.wait(timeout=max(remaining, 0.1))
        except subprocess.TimeoutExpired:
            self.kill()
            self._reader.join(5)
            raise DsgenError(f"dsgen timed out after {self.timeout}s (killed)", self.output) from None
        self._reader.join(30)
        if rc != 0:
            raise DsgenError(f"dsgen exited with {rc}", self.output)
        done = [e for e in self.events if e.get("event") == "done"]
        if not done:
            raise DsgenError("dsgen exited 0 without a 'done' event", self.output)
        return self._result(done[-1], time.monotonic() - self._t0)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def _result(self, done: dict[str, Any], wall: float) -> dict[str, Any]:
        cfg = done["config"]
        ckpts: dict[int, dict[str, Any]] = {}
        shards: dict[int, dict[int, str]] = collections.defaultdict(dict)
        for ev in self.events:
            if ev.get("event") == "shard_written":
                shards[ev["step"]][ev["rank"]] = ev["file"]
        for step in cfg["steps"]:
            save_dir = Path(done["save_dirs"][str(step)])
            tag_dir = save_dir / f"global_step{step}"
            ckpts[step] = {
                "save_dir": save_dir,
                "tag": f"global_step{step}",
                "tag_dir": tag_dir,
                # a checkpoint may be gone already: retention (ckptd run) can delete it mid-job
                "files": sorted(p.name for p in tag_dir.iterdir()) if tag_dir.is_dir() else [],
                "save_dir_files": sorted(p.name for p in save_dir.iterdir()) if save_dir.is_dir() else [],
                "optim_shards": [shards[step][r] for r in sorted(shards[step])],
                "model_states": sorted(p.name for p in tag_dir.glob("*model_states.pt")),
                "eval_loss": done["eval_losses"][str(step)],
            }
        last = ckpts[cfg["steps"][-1]]
        return {
            "out_dir": self.out_dir,
            **{k: cfg[k] for k in ("world_size", "stage", "bf16", "offload", "layout", "steps")},
            "checkpoints": ckpts,
            "shard_files": last["optim_shards"],
            "model_states_files": last["model_states"],
            "eval_losses": {int(k): v for k, v in done["eval_losses"].items()},
            "wall_s": wall,
            "child_timings": done["timings"],
            "events": list(self.events),
        }


def start(
    out_dir,
    *,
    world_size: int = 2,
    stage: int = 2,
    bf16: bool = False,
    offload: bool = False,
    layout: str = "hf",
    steps: Iterable[int] = (10, 20, 30),
    eval_losses=None,
    slow_rank: int | None = None,
    slow_seconds: float = 0.0,
    slow_step: int | None = None,
    train_steps_per_save: int | None = None,
    seed: int = 1234,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    config_as_path: bool = False,
    grad_accum_fp32: bool = False,
    trainer_weights: bool = False,
    hidden: int = 32,
    layers: int = 0,
    save_gap: float = 0.0,
) -> Run:
    """Start a DeepSpeed run in the background and return a :class:`Run`.

    With ``slow_rank``, that rank's ZeRO optimizer shard for ``slow_step``
    (default: the last step) is held back: the rank waits until every other
    rank has written its shard and rank 0 has written ``latest``, then creates
    ``<out>/.slow_rank_waiting`` (JSON), emits the ``slow_rank_waiting`` event,
    holds for ``slow_seconds`` (or until :meth:`Run.release`), writes its shard,
    removes the marker and emits ``slow_rank_done``.

    ``trainer_weights`` (Trainer layout): rank 0 also writes ``checkpoint-N/model.safetensors``
    as the Trainer does under DeepSpeed, before the DeepSpeed checkpoint: the engine module's
    own state dict (16-bit with ``bf16``; gathered at ZeRO-3, as with
    ``stage3_gather_16bit_weights_on_model_save``), saved by ``safetensors.torch.save_file``
    with ``{"format": "pt"}`` (what ``save_pretrained`` calls; the MLP is no PreTrainedModel).
    ``hidden``/``layers``: the MLP is Linear(16, hidden), then ``layers`` Linear(hidden, hidden),
    then Linear(hidden, 8); the defaults are the tiny model every test uses.
    ``save_gap``: seconds every rank spends before each save, standing in for the training
    between saves (the tiny model's steps take milliseconds), so that saves are apart in time.
    """
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    argv = _cli_args(
        out,
        world_size=world_size,
        stage=stage,
        bf16=bf16,
        offload=offload,
        layout=layout,
        steps=list(steps),
        eval_losses=eval_losses,
        slow_rank=slow_rank,
        slow_seconds=slow_seconds,
        slow_step=slow_step,
        train_steps_per_save=train_steps_per_save,
        seed=seed,
        timeout=timeout,
        config_as_path=config_as_path,
        grad_accum_fp32=grad_accum_fp32,
        trainer_weights=trainer_weights,
        hidden=hidden,
        layers=layers,
        save_gap=save_gap,
    )
    return Run(out, argv, timeout, env)


def generate(
    out_dir,
    *,
    world_size: int = 2,
    stage: int = 2,
    bf16: bool = False,
    offload: bool = False,
    layout: str = "hf",
    steps: Iterable[int] = (10, 20, 30),
    eval_losses=None,
    slow_rank: int | None = None,
    slow_seconds: float = 0.0,
    timeout: float = 300,
    **kw,
) -> dict[str, Any]:
    """Run DeepSpeed to completion and return metadata.

    Layouts (N = each step):
      * ``"hf"``:   ``<out>/checkpoint-N/`` is the save_dir, tag ``global_stepN``;
        each rank writes ``checkpoint-N/rng_state_<rank>.pth``; after a barrier
        rank 0 writes ``checkpoint-N/trainer_state.json`` last.
      * ``"bare"``: ``<out>`` is the save_dir, tag ``global_stepN``; ``<out>/latest``.

    ``eval_losses``: list aligned with ``steps`` or ``{step: loss}``; default is
    the model's real loss on a fixed eval batch.  Returned dict keys:
    out_dir, world_size, stage, bf16, offload, layout, steps, checkpoints
    ({step: {save_dir, tag, tag_dir, files, save_dir_files, optim_shards,
    model_states, eval_loss}}), shard_files, model_states_files (of the last
    step), eval_losses, wall_s, child_timings, events.
    """
    with start(
        out_dir,
        world_size=world_size,
        stage=stage,
        bf16=bf16,
        offload=offload,
        layout=layout,
        steps=steps,
        eval_losses=eval_losses,
        slow_rank=slow_rank,
        slow_seconds=slow_seconds,
        timeout=timeout,
        **kw,
    ) as run:
        return run.wait()


# --------------------------------------------------------------------------
# Loading helpers (import torch lazily; call them in a subprocess if the
# test process must stay torch-free)
# --------------------------------------------------------------------------


def optim_safe_globals() -> list:
    """Globals that ``torch.load(weights_only=True)`` needs for ``*_optim_states.pt``."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def load_world_sizes(model_states_path) -> dict[str, Any]:
    """Load a ``*model_states.pt`` with the safe loader and return its topology."""
    import torch

    sd = torch.load(str(model_states_path), map_location="cpu", weights_only=True, mmap=True)
    zero = (sd.get("ds_config") or {}).get("zero_optimization") or {}
    return {
        "dp_world_size": sd.get("dp_world_size"),
        "mp_world_size": sd.get("mp_world_size"),
        "zero_stage": zero.get("stage"),
        "global_steps": sd.get("global_steps"),
        "ds_version": sd.get("ds_version"),
        "keys": sorted(sd),
    }


def load_optim_shard(path) -> dict[str, Any]:
    import torch

    with torch.serialization.safe_globals(optim_safe_globals()):
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)


# --------------------------------------------------------------------------
# Child side: the DeepSpeed job (only imported/run in the subprocess)
# --------------------------------------------------------------------------


def _emit(event: str, **fields) -> None:
    # one write() < PIPE_BUF per line, so lines from different ranks don't interleave
    sys.stdout.write(EVENT_PREFIX + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def _free_ports(n: int) -> list[int]:
    """n distinct free TCP ports (all bound at once, then released)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _quiet_deepspeed() -> None:
    import logging

    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.ERROR)
        for h in ds_logger.handlers:
            h.setLevel(logging.ERROR)
    except Exception:  # pragma: no cover
        pass


def _skip_shm_build() -> None:
    """Make DeepSpeed use plain gloo collectives instead of JIT-building its
    shared-memory comm op with g++ (~45 s on first init).

    deepspeed/comm/torch.py: ``TorchBackend.__init__`` calls the module-global
    ``build_shm_op()``, which returns None when the ShareMemCommBuilder is not
    in ``deepspeed.ops.__compatible_ops__``; with None every collective goes to
    torch.distributed (gloo).  There is no env var for this in 0.19.8, so we
    replace the function.  Pre-seeding ``deepspeed.ops.__compatible_ops__`` also
    avoids the lazy compatibility probe of every op builder.
    """
    import deepspeed.comm.torch as ds_torch_comm
    import deepspeed.ops as ds_ops

    ds_torch_comm.build_shm_op = lambda: None
    if "__compatible_ops__" not in vars(ds_ops):
        ds_ops.__compatible_ops__ = {"deepspeed_shm_comm": False}


def _worker(rank: int, cfg: dict) -> None:
    t_start = time.monotonic()
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(cfg["world_size"]),
            "LOCAL_SIZE": str(cfg["world_size"]),
            "LOCAL_WORLD_SIZE": str(cfg["world_size"]),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(cfg["port"]),
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
        }
    )
    import datetime
    import logging

    # Run.release() sends SIGUSR1; never let a late one kill the rank (default action).
    signal.signal(signal.SIGUSR1, lambda *_: None)
    logging.getLogger().setLevel(logging.ERROR)
    import torch

    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.runtime.engine as ds_engine_mod

    _quiet_deepspeed()
    if os.environ.get("DSGEN_KEEP_SHM") != "1":  # set to 1 only to measure the g++ build
        _skip_shm_build()
    t_import = time.monotonic()
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False)
    import torch.distributed as tdist

    store = None
    if cfg["slow_rank"] is not None:
        store = tdist.TCPStore(
            "127.0.0.1",
            cfg["store_port"],
            cfg["world_size"],
            is_master=(rank == 0),
            timeout=datetime.timedelta(seconds=cfg["timeout"]),
        )

    torch.manual_seed(cfg["seed"])
    h = cfg.get("hidden", 32)
    inner = [m for _ in range(cfg.get("layers", 0)) for m in (torch.nn.Linear(h, h), torch.nn.ReLU())]
    model = torch.nn.Sequential(torch.nn.Linear(16, h), torch.nn.ReLU(), *inner, torch.nn.Linear(h, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zero: dict[str, Any] = {"stage": cfg["stage"]}
    if cfg["offload"]:
        zero["offload_optimizer"] = {"device": "cpu"}
    if cfg["stage"] == 3:
        # tiny model: make sure parameters really are partitioned, not persisted whole
        zero["stage3_param_persistence_threshold"] = 0
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": bool(cfg["bf16"])},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if cfg.get("grad_accum_fp32"):  # bf16 at stage 0 then takes DeepSpeed's BF16_Optimizer: per-rank shards
        ds_config["data_types"] = {"grad_accum_dtype": "fp32"}
    config: dict[str, Any] | str = ds_config
    if cfg.get("config_path"):  # as a JSON file's path: the model states then record the path, not the dict
        config = str(Path(cfg["out"]) / f".ds_config.rank{rank}.json")
        Path(config).write_text(json.dumps(ds_config))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    _quiet_deepspeed()
    if os.environ.get("DSGEN_ATTEST") == "1":  # ckptd's commit records, from each rank's save_checkpoint
        from ckptd.integrations.deepspeed import wrap

        engine = wrap(engine, heartbeat=0.2)
    t_init = time.monotonic()
    dtype = torch.bfloat16 if cfg["bf16"] else torch.float32

    gen = torch.Generator().manual_seed(cfg["seed"] + 1 + rank)  # per-rank data
    eval_gen = torch.Generator().manual_seed(cfg["seed"] + 999)  # same eval batch on all ranks
    x_eval = torch.randn(16, 16, generator=eval_gen).to(dtype)
    y_eval = torch.randn(16, 8, generator=eval_gen).to(dtype)

    # -- slow-rank / bookkeeping hooks ---------------------------------------
    state = {"step": None}
    slow_rank, slow_step = cfg["slow_rank"], cfg["slow_step"]
    orig_save_zero = engine._save_zero_checkpoint
    orig_save_states = engine._save_checkpoint
    # DSGEN_HOLD=states: the slow rank is held before its model states (engine._save_checkpoint)
    # instead of before its shard, once every other rank has written its shard
    hold_states = os.environ.get("DSGEN_HOLD") == "states"

    def hold(step, tag, save_path, held_file, then):
        """Wait for the other ranks' files, hold (`slow_seconds` or SIGUSR1), then `then()`."""
        keys = [f"shard/{step}/{r}" for r in range(cfg["world_size"]) if r != rank]
        if rank != 0:
            keys.append(f"latest/{step}")
        store.wait(keys, datetime.timedelta(seconds=cfg["timeout"]))
        marker = Path(cfg["out"]) / SLOW_MARKER
        info = {
            "rank": rank,
            "pid": os.getpid(),
            "step": step,
            "tag": tag,
            "save_dir": save_path,
            "shard": held_file,
        }
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        tmp = marker.with_name(marker.name + ".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, marker)
        listing = {str(p.relative_to(cfg["out"])) for p in Path(cfg["out"]).rglob("*")}
        _emit("slow_rank_waiting", listing=sorted(listing), **info)
        t0 = time.monotonic()
        # the deliberate delay; SIGUSR1 (Run.release) ends it early
        released = signal.sigtimedwait([signal.SIGUSR1], cfg["slow_seconds"]) is not None
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        held = time.monotonic() - t0
        then()
        marker.unlink()
        _emit("slow_rank_done", rank=rank, step=step, shard=held_file, held_s=held, released=released)

    def save_states(save_dir, tag, *a, **k):
        if hold_states and rank == slow_rank and state["step"] == slow_step:
            name = engine._get_ckpt_name(save_dir, tag)
            hold(state["step"], tag, save_dir, name, lambda: orig_save_states(save_dir, tag, *a, **k))
        else:
            orig_save_states(save_dir, tag, *a, **k)

    def save_zero(save_path, tag):
        step = state["step"]
        shard = engine._get_zero_ckpt_name(save_path, tag)
        if rank == slow_rank and step == slow_step and not hold_states:
            hold(step, tag, save_path, shard, lambda: orig_save_zero(save_path, tag))
        else:
            orig_save_zero(save_path, tag)
            if store is not None and step == slow_step:
                store.set(f"shard/{step}/{rank}", "1")
        _emit("shard_written", rank=rank, step=step, file=os.path.basename(shard), path=shard)

    engine._save_zero_checkpoint = save_zero
    engine._save_checkpoint = save_states

    if store is not None and rank == 0 and slow_rank != 0:
        # Signal "rank 0 has written <save_dir>/latest": engine.save_checkpoint
        # writes it with a bare open(); a module-global `open` shadows the builtin.
        import builtins

        class _Tracked:
            def __init__(self, f, step):
                self._f, self._step = f, step

            def __enter__(self):
                self._f.__enter__()
                return self._f

            def __exit__(self, *exc):
                r = self._f.__exit__(*exc)
                store.set(f"latest/{self._step}", "1")
                return r

        def _open(file, mode="r", *a, **k):
            f = builtins.open(file, mode, *a, **k)  # noqa: SIM115 (handed to the caller's `with`)
            if os.path.basename(str(file)) == "latest" and "w" in mode and state["step"] == slow_step:
                return _Tracked(f, state["step"])
            return f

        ds_engine_mod.open = _open

    # -- train / save --------------------------------------------------------
    out = Path(cfg["out"])
    loss_fn = torch.nn.MSELoss()
    save_dirs: dict[str, str] = {}
    eval_losses: dict[str, float] = {}
    log_history: list[dict[str, Any]] = []
    t_train = t_save = 0.0
    for step in cfg["steps"]:
        t0 = time.monotonic()
        n_train = cfg["train_steps_per_save"] or max(step - engine.global_steps, 1)
        for _ in range(n_train):
            x = torch.randn(4, 16, generator=gen).to(dtype)
            y = torch.randn(4, 8, generator=gen).to(dtype)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
        with torch.no_grad():
            real_eval = float(loss_fn(engine(x_eval), y_eval).float())
        t_train += time.monotonic() - t0
        eval_loss = cfg["eval_losses"][str(step)] if cfg["eval_losses"] else real_eval
        eval_losses[str(step)] = eval_loss

        if cfg.get("save_gap"):
            time.sleep(cfg["save_gap"])  # the training between saves, not synchronisation
        t0 = time.monotonic()
        state["step"] = step
        tag = f"global_step{step}"
        save_dir = out / f"checkpoint-{step}" if cfg["layout"] == "hf" else out
        save_dirs[str(step)] = str(save_dir)
        if cfg.get("trainer_weights"):
            # The Trainer's save_model under DeepSpeed (accelerate's get_state_dict, then
            # save_pretrained -> safetensors' save_file), before engine.save_checkpoint.
            if cfg["stage"] == 3:
                weights = engine._zero3_consolidated_16bit_state_dict()  # a collective: every rank
            else:
                weights = engine.module.state_dict()
            if rank == 0:
                from safetensors.torch import save_file

                save_dir.mkdir(parents=True, exist_ok=True)
                tensors = {k: v.detach().clone().contiguous() for k, v in weights.items()}
                save_file(tensors, str(save_dir / "model.safetensors"), metadata={"format": "pt"})
            tdist.barrier()
        engine.save_checkpoint(str(save_dir), tag=tag)
        if cfg["layout"] == "hf":
            rng = {"python": __import__("random").getstate(), "cpu": torch.random.get_rng_state()}
            torch.save(rng, save_dir / f"rng_state_{rank}.pth")
            log_history.append({"epoch": step / cfg["steps"][-1], "eval_loss": eval_loss, "step": step})
            tdist.barrier()
            if rank == 0:
                best_step = min((h for h in log_history), key=lambda h: (h["eval_loss"], h["step"]))["step"]
                ts = {
                    "best_global_step": best_step,
                    "best_metric": min(h["eval_loss"] for h in log_history),
                    "best_model_checkpoint": str(out / f"checkpoint-{best_step}"),
                    "epoch": step / cfg["steps"][-1],
                    "eval_steps": None,
                    "global_step": step,
                    "is_hyper_param_search": False,
                    "is_local_process_zero": True,
                    "is_world_process_zero": True,
                    "log_history": list(log_history),
                    "logging_steps": 500,
                    "max_steps": cfg["steps"][-1],
                    "num_input_tokens_seen": 0,
                    "num_train_epochs": 1,
                    "save_steps": None,
                    "stateful_callbacks": {},
                    "total_flos": 0.0,
                    "train_batch_size": 4,
                    "trial_name": None,
                    "trial_params": None,
                }
                (save_dir / "trainer_state.json").write_text(json.dumps(ts, indent=2, sort_keys=True) + "\n")
            tdist.barrier()
        t_save += time.monotonic() - t0
        if rank == 0:
            _emit("saved", step=step, save_dir=str(save_dir), tag=tag)

    tdist.barrier()
    if rank == 0:
        _emit(
            "done",
            config={k: cfg[k] for k in ("world_size", "stage", "bf16", "offload", "layout", "steps")},
            save_dirs=save_dirs,
            eval_losses=eval_losses,
            timings={
                "import_s": t_import - t_start,
                "init_s": t_init - t_import,
                "train_s": t_train,
                "save_s": t_save,
                "worker_s": time.monotonic() - t_start,
            },
        )
    tdist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--config-path", action="store_true", help="pass ds_config as a JSON file's path")
    p.add_argument("--grad-accum-fp32", action="store_true", help="data_types.grad_accum_dtype = fp32")
    p.add_argument("--offload", action="store_true", help="offload_optimizer device=cpu")
    p.add_argument("--layout", choices=("hf", "bare"), default="hf")
    p.add_argument("--steps", type=int, nargs="+", default=[10, 20, 30])
    p.add_argument("--eval-losses", type=float, nargs="+")
    p.add_argument("--slow-rank", type=int)
    p.add_argument("--slow-seconds", type=float, default=0.0)
    p.add_argument("--slow-step", type=int, help="step whose save is slowed (default: last)")
    p.add_argument(
        "--train-steps-per-save",
        type=int,
        help="optimizer steps before each save (default: up to the step number, "
        "so engine.global_steps == N in the checkpoint)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--trainer-weights", action="store_true", help="hf layout: model.safetensors as the Trainer")
    p.add_argument("--hidden", type=int, default=32, help="the MLP's width")
    p.add_argument("--layers", type=int, default=0, help="hidden Linear(hidden, hidden) layers")
    p.add_argument("--save-gap", type=float, default=0.0, help="seconds before each save (the training)")
    p.add_argument("--timeout", type=float, default=300, help="bound for in-child store waits (s)")
    a = p.parse_args(argv)
    for k, v in _CHILD_ENV.items():
        os.environ.setdefault(k, v)
    _cli_args(
        a.out,
        world_size=a.world_size,
        stage=a.stage,
        bf16=a.bf16,
        offload=a.offload,
        layout=a.layout,
        steps=a.steps,
        eval_losses=a.eval_losses,
        slow_rank=a.slow_rank,
        slow_seconds=a.slow_seconds,
        slow_step=a.slow_step,
        train_steps_per_save=a.train_steps_per_save,
        seed=a.seed,
        trainer_weights=a.trainer_weights,
        hidden=a.hidden,
        layers=a.layers,
    )  # validation
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "out": str(out),
        "world_size": a.world_size,
        "stage": a.stage,
        "bf16": a.bf16,
        "config_path": a.config_path,
        "grad_accum_fp32": a.grad_accum_fp32,
        "offload": a.offload,
        "layout": a.layout,
        "steps": a.steps,
        "eval_losses": dict(zip(map(str, a.steps), a.eval_losses, strict=True)) if a.eval_losses else None,
        "slow_rank": a.slow_rank,
        "slow_seconds": a.slow_seconds,
        "slow_step": a.slow_step if a.slow_step is not None else a.steps[-1],
        "train_steps_per_save": a.train_steps_per_save,
        "seed": a.seed,
        "timeout": a.timeout,
        "trainer_weights": a.trainer_weights,
        "hidden": a.hidden,
        "layers": a.layers,
        "save_gap": a.save_gap,
    }
    cfg["port"], cfg["store_port"] = _free_ports(2)
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(cfg,), nprocs=a.world_size, join=True)
    return 0


if __name__ == "__main__":
    refuse_in_light_test("a DeepSpeed job (tests/support/dsgen.py)")
    sys.exit(main())
