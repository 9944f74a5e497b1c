"""Generate REAL framework checkpoints on the CPU for ckptd's tests, with saves really killed mid-way.

Orbax (with jax), accelerate, Lightning, the Hugging Face Trainer and torch.distributed.checkpoint
(DCP, laid out as torchtitan names it) save tiny models with their own saving code.  Some saves are
killed mid-way: a hook inside the framework's writer reports to the coordinator and blocks; the
coordinator SIGKILLs the writer's whole process group; then the framework's own loader (Orbax's
``all_steps()`` and ``restore``, accelerate's ``load_state``, Lightning's ``torch.load`` and
``Trainer.fit(ckpt_path=...)``, the Trainer's ``get_last_checkpoint`` and
``train(resume_from_checkpoint=...)``, ``dcp.load``) records the ground truth of every state.
FWGEN_NOTES.md has what ends up on disk, the save orders (with the upstream source cited) and timings.

Test-side use (this module imports no framework; everything runs in a fresh
``python tests/fwgen.py FRAMEWORK OUT`` coordinator, killed as a process group on timeout)::

    from fwgen import generate_orbax, missing
    if (why := missing("orbax")) is None:
        info = generate_orbax(tmp_path / "vol")
        info["checkpoints"]        # one record per checkpoint: path, run, step, killed, truth
        info["runs"]["commit_file"]["truth"]["all_steps"]

CLI::

    python tests/fwgen.py orbax OUT          # or accelerate, lightning, trainer, dcp
    python tests/fwgen.py all OUT            # each framework under OUT/<framework>/

Process shape, per framework: the coordinator imports the framework once (except jax, which must not
be forked after it starts), then forks one process group per job (the writers, 1 or 2 ranks; gloo
for 2).  Forked children inherit the imports, so a job costs no import time.  A killed job's hook
sends ``hold`` on a pipe and blocks forever; the coordinator kills the group (SIGKILL) only when every
expected hold has arrived.  The children die with the coordinator (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import importlib.util
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "EVENT_PREFIX",
    "FRAMEWORKS",
    "FwgenError",
    "generate",
    "generate_accelerate",
    "generate_dcp",
    "generate_lightning",
    "generate_orbax",
    "generate_trainer",
    "missing",
]

EVENT_PREFIX = "@@fwgen "
_HERE = Path(__file__).resolve()

# What each generator needs importable (top-level names, looked up without importing them).
FRAMEWORKS: dict[str, tuple[str, ...]] = {
    "orbax": ("jax", "orbax.checkpoint"),
    "accelerate": ("torch", "accelerate", "safetensors"),
    "lightning": ("torch", "lightning"),
    "trainer": ("torch", "transformers", "accelerate", "safetensors"),
    "dcp": ("torch",),
}

# Environment of the coordinator and its jobs: CPU only, no downloads, quiet, one thread per rank
# (2 ranks on a 2-core box oversubscribe badly otherwise).
_CHILD_ENV = {
    "JAX_PLATFORMS": "cpu",
    "CUDA_VISIBLE_DEVICES": "",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "PYTHONUNBUFFERED": "1",
    "PYTHONWARNINGS": "ignore",
    "WANDB_DISABLED": "true",
    "DISABLE_MLFLOW_INTEGRATION": "TRUE",
}

# Lightning's ModelCheckpoint logs these val_loss values (epoch -> value): the best is epoch 1,
# neither the oldest nor the newest.  The Trainer's runs log EVAL_LOSSES the same way.
VAL_LOSSES = (0.9, 0.4, 0.6, 0.7)
EVAL_LOSSES = {2: 0.9, 4: 0.4, 6: 0.6, 8: 0.7, 10: 0.5}
ORBAX_LOSSES = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.6}


class FwgenError(RuntimeError):
    """The coordinator failed or timed out; ``output`` holds its log."""

    def __init__(self, msg: str, output: str = ""):
        super().__init__(f"{msg}\n--- fwgen output (tail) ---\n{output[-8000:]}")
        self.output = output


# --------------------------------------------------------------------------
# Parent side (imports no framework)
# --------------------------------------------------------------------------


def missing(framework: str) -> str | None:
    """Why ``framework`` cannot be generated here (a module not installed), or None.

    Decided with ``importlib.util.find_spec`` on the top-level names: nothing is imported (jax and
    transformers take seconds to import)."""
    for name in FRAMEWORKS[framework]:
        top = name.split(".")[0]
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{framework}: {top} is not installed (pip install -e '.[test]')"
    return None


def generate(frameworks: str | Sequence[str], out_dir, *, timeout: float = 600,
             env: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Run one coordinator for ``frameworks`` (each under ``out_dir/<framework>``); {framework: result}.

    One coordinator for several torch frameworks imports torch (and what they share) once."""
    names = [frameworks] if isinstance(frameworks, str) else list(frameworks)
    for name in names:
        if name not in FRAMEWORKS:
            raise ValueError(f"unknown framework {name!r} (known: {', '.join(FRAMEWORKS)})")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    child_env = dict(os.environ)
    child_env.update(_CHILD_ENV)
    child_env.update(env or {})
    t0 = time.monotonic()
    lines: collections.deque[str] = collections.deque(maxlen=3000)
    events: list[dict[str, Any]] = []
    proc = subprocess.Popen(
        [sys.executable, str(_HERE), ",".join(names), str(out)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=child_env,
        start_new_session=True,
        text=True,
        errors="replace",
    )

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(EVENT_PREFIX):
                with contextlib.suppress(ValueError):
                    events.append(json.loads(line[len(EVENT_PREFIX):]))
                    continue
            lines.append(line)

    reader = threading.Thread(target=read, name="fwgen-reader", daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the coordinator's session; its jobs die with it
        proc.wait()
        reader.join(10)
        raise FwgenError(f"fwgen {names} timed out after {timeout}s (killed)", "".join(lines)) from None
    reader.join(30)
    if proc.stdout is not None:
        proc.stdout.close()
    output = "".join(lines)
    if rc != 0:
        raise FwgenError(f"fwgen {names} exited with {rc}", output)
    results: dict[str, dict[str, Any]] = {}
    for ev in events:
        if ev.get("event") == "done":
            result = ev["result"]
            results[ev["framework"]] = _absolute(result, out / ev["framework"])
    lost = [n for n in names if n not in results]
    if lost:
        raise FwgenError(f"fwgen exited 0 without a result for {lost}", output)
    wall = time.monotonic() - t0
    for result in results.values():
        result["coordinator_wall_s"] = wall
    return results


def _absolute(result: dict[str, Any], root: Path) -> dict[str, Any]:
    result["out_dir"] = root
    for rec in result.get("checkpoints", []):
        rec["abs_path"] = root / rec["path"]
    return result


def generate_orbax(out_dir, *, timeout: float = 300, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Orbax ``CheckpointManager`` runs under ``out_dir/orbax`` (see FWGEN_NOTES.md, "Orbax")."""
    return generate("orbax", out_dir, timeout=timeout, env=env)["orbax"]


def generate_accelerate(out_dir, *, timeout: float = 300, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """accelerate ``save_state`` runs (2 processes, gloo) under ``out_dir/accelerate``."""
    return generate("accelerate", out_dir, timeout=timeout, env=env)["accelerate"]


def generate_lightning(out_dir, *, timeout: float = 300, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Lightning ``ModelCheckpoint`` runs under ``out_dir/lightning``."""
    return generate("lightning", out_dir, timeout=timeout, env=env)["lightning"]


def generate_trainer(out_dir, *, timeout: float = 300, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """HF Trainer runs (2-process DDP, gloo) under ``out_dir/trainer``."""
    return generate("trainer", out_dir, timeout=timeout, env=env)["trainer"]


def generate_dcp(out_dir, *, timeout: float = 300, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """torch.distributed.checkpoint runs (2 ranks, gloo, torchtitan's ``step-N`` names) under ``out_dir/dcp``."""
    return generate("dcp", out_dir, timeout=timeout, env=env)["dcp"]


# --------------------------------------------------------------------------
# Child side, common: events, jobs, holds
# --------------------------------------------------------------------------


def _emit(event: str, **fields) -> None:
    sys.stdout.write(EVENT_PREFIX + json.dumps({"event": event, **fields}, default=str) + "\n")
    sys.stdout.flush()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PR_SET_PDEATHSIG = 1
_job_ctx: dict[str, Any] = {}  # in a job's process: rank, world_size, pipe fd, control dir


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl
        os._exit(1)


def report(kind: str, **fields) -> None:
    """From a job: one message to the coordinator (a line under PIPE_BUF, so ranks never interleave)."""
    msg = json.dumps({"kind": kind, "rank": _job_ctx.get("rank"), "pid": os.getpid(), **fields}, default=str)
    data = (msg + "\n").encode()
    if len(data) > 4000:
        raise ValueError(f"report too long ({len(data)} bytes)")
    os.write(_job_ctx["pipe"], data)


def hold(point: str, **fields) -> None:
    """Inside a framework's writer: tell the coordinator where we are, then block until killed."""
    report("hold", point=point, **fields)
    threading.Event().wait()  # SIGKILL ends it; works in any thread (Orbax holds in its commit thread)


def write_result(name: str, data: Any) -> None:
    """From a job: a JSON document the coordinator reads after the job (any size)."""
    path = Path(_job_ctx["ctl"]) / f"{_job_ctx['job']}.{name}.r{_job_ctx.get('rank', 0)}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, default=str, indent=1))
    os.replace(tmp, path)


class Job:
    """One forked process group: ``nprocs`` ranks running ``fn(rank, world_size, **kw)``."""

    def __init__(self, ctl: Path, name: str, fn: Callable[..., None], nprocs: int = 1, **kw):
        self.name = name
        self.ctl = ctl
        self.nprocs = nprocs
        self.messages: list[dict[str, Any]] = []
        self._buf = b""
        self.t0 = time.monotonic()
        self.pids: list[int] = []
        self.status: dict[int, int] = {}
        self.wall_s = 0.0
        r, w = os.pipe()
        self._r = r
        port = _free_port()
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pgid = 0
        for rank in range(nprocs):
            pid = os.fork()
            if pid == 0:  # the rank
                code = 1
                try:
                    os.close(r)
                    os.setpgid(0, pgid)
                    _die_with_parent(parent)
                    _job_ctx.update(rank=rank, world_size=nprocs, pipe=w, ctl=str(ctl), job=name)
                    os.environ.update({
                        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                        "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                    })
                    if nprocs == 1:
                        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                            os.environ.pop(k)
                    fn(rank, nprocs, **kw)
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            with contextlib.suppress(PermissionError, ProcessLookupError):  # the child may have done it
                os.setpgid(pid, pgid or pid)
            pgid = pgid or pid
            self.pids.append(pid)
        self.pgid = pgid
        os.close(w)

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self._r], [], [], max(timeout, 0))
        if not ready:
            return True
        chunk = os.read(self._r, 65536)
        if not chunk:
            return False
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        self.messages.extend(json.loads(line) for line in lines if line)
        return True

    def holds(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["kind"] == "hold"]

    def kill_at(self, n_holds: int, timeout: float = 180) -> list[dict[str, Any]]:
        """Wait until ``n_holds`` writers hold, then SIGKILL the job's process group."""
        deadline = time.monotonic() + timeout
        open_ = True
        while len(self.holds()) < n_holds and open_ and time.monotonic() < deadline:
            open_ = self._read(deadline - time.monotonic())
            self._reap(block=False)
            if self.status and any(code != 0 for code in self.status.values()):
                break
        held = self.holds()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        self._reap(block=True)
        os.close(self._r)
        if len(held) < n_holds:
            raise RuntimeError(f"job {self.name}: {len(held)} of {n_holds} holds before "
                               f"{'exit' if not open_ or self.status else 'timeout'} (exit codes {self.status})")
        self.wall_s = time.monotonic() - self.t0
        _emit("killed", job=self.name, holds=held, wall_s=self.wall_s)
        return held

    def join(self, timeout: float = 240) -> list[dict[str, Any]]:
        """Wait for a job that must finish by itself; raise if a rank failed."""
        deadline = time.monotonic() + timeout
        while len(self.status) < self.nprocs and time.monotonic() < deadline:
            if not self._read(min(0.5, deadline - time.monotonic())):
                self._reap(block=True)
                break
            self._reap(block=False)
            if any(code != 0 for code in self.status.values()):
                break
        if len(self.status) < self.nprocs or any(code != 0 for code in self.status.values()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGKILL)
            self._reap(block=True)
            os.close(self._r)
            raise RuntimeError(f"job {self.name} failed: exit codes {self.status} (a rank's traceback is above)")
        with contextlib.suppress(OSError):
            while self._read(0.0) and select.select([self._r], [], [], 0)[0]:
                pass
        os.close(self._r)
        self.wall_s = time.monotonic() - self.t0
        _emit("joined", job=self.name, wall_s=self.wall_s)
        return self.messages

    def _reap(self, block: bool) -> None:
        for pid in self.pids:
            if pid in self.status:
                continue
            try:
                got, st = os.waitpid(pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                self.status[pid] = -1
                continue
            if got:
                self.status[pid] = os.waitstatus_to_exitcode(st)

    def results(self, name: str) -> list[Any]:
        """The documents the ranks wrote with :func:`write_result` (rank order)."""
        return [json.loads((self.ctl / f"{self.name}.{name}.r{r}.json").read_text()) for r in range(self.nprocs)]


def _error(exc: BaseException) -> str:
    """``Type: first line``, and the last line when there are more (DCP puts the cause last)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = lines[0][:300] if lines else ""
    if len(lines) > 1:
        text += f" ... {lines[-1][:300]}"
    return f"{type(exc).__name__}: {text}"


def _rel(path, root: Path) -> str:
    return str(Path(path).resolve().relative_to(root))


def _tree(root: Path) -> list[str]:
    """Every entry under root (dirs end in '/'), relative, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        out += [f"{(rel / d).as_posix()}/" for d in dirnames]
        out += [(rel / f).as_posix() for f in filenames]
    return sorted(out)


def _record(root: Path, path: Path, run: Path, step: int | None, *, killed: str | None,
            truth: dict[str, Any], **extra) -> dict[str, Any]:
    """One checkpoint of a generated volume, as every generator describes it."""
    return {
        "path": _rel(path, root),
        "run": _rel(run, root),
        "step": step,
        "killed": killed,  # None: the save finished; else where the writer was killed
        "truth": truth,  # what the framework's own loader says; truth["ok"]: it can be resumed from
        **extra,
    }


# --------------------------------------------------------------------------
# Orbax (jax must not be forked once started: the coordinator imports it only after forking)
# --------------------------------------------------------------------------

_ORBAX_KILLED = {
    # run name -> (CheckpointManagerOptions kwargs name, where the step-3 save is held)
    "default": ("atomic_rename", "before_finalize"),
    "commit_file": ("commit_file", "before_finalize"),
    "commit_file_late": ("commit_file", "before_commit_success"),
    "commit_file_midwrite": ("commit_file", "before_item_finalize"),
    # last: the directory is created on the thread that calls save(), so this hold blocks it
    "commit_file_early": ("commit_file", "after_create"),
}
_ORBAX_COMPLETE = {
    # run name -> (options kwargs, steps)
    "step_prefix": ({"step_prefix": "step"}, (100, 200)),
    "fixed_length": ({"step_format_fixed_length": 8}, (100, 200)),
    "prefix_fixed": ({"step_prefix": "step", "step_format_fixed_length": 6}, (100, 200)),
    "best_fn": ({"best": True}, tuple(ORBAX_LOSSES)),
}


def _orbax_options(ocp, mode: str | None = None, **kw):
    from orbax.checkpoint import options as ocp_options

    if kw.pop("best", False):
        kw.update(best_fn=lambda metrics: metrics["loss"], best_mode="min")
    if mode == "commit_file":
        kw["atomicity_options"] = ocp_options.AtomicityOptions(mode=ocp_options.AtomicityMode.COMMIT_FILE)
    return ocp.CheckpointManagerOptions(**kw)


def _orbax_state():
    import jax.numpy as jnp

    return {"params": {"w": jnp.arange(16.0).reshape(4, 4), "b": jnp.ones(4)}, "step": jnp.array(0)}


def _orbax_killed_job(rank: int, world: int, out: str) -> None:
    """Steps 1 and 2 saved whole, then every run's step 3 held at its kill point, all at once.

    Orbax commits a save on a background thread (AsyncCheckpointer's commit callback), so the four
    managers' step-3 commits block side by side and one SIGKILL leaves all four states."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.path import async_path, atomicity

    held_at: dict[str, str] = {}  # final path of a held step (or item) -> point

    def patch(cls):
        original_create, original_finalize = cls.create, cls.finalize

        async def create(self):
            created = await original_create(self)
            if held_at.get(str(self.get_final())) == "after_create":
                hold("after_create", path=str(self.get_final()), temporary=str(self.get()))
            return created

        async def finalize(self):
            final = str(self.get_final())
            if held_at.get(final) in ("before_finalize", "before_item_finalize"):
                hold(held_at[final], path=final, temporary=str(self.get()))
            return await original_finalize(self)

        cls.create, cls.finalize = create, finalize

    patch(atomicity.AtomicRenameTemporaryPath)
    patch(atomicity.CommitFileTemporaryPath)
    write_text = async_path.write_text  # CommitFileTemporaryPath.finalize writes commit_success.txt last

    async def write_text_hook(path, text, *a, **k):
        if Path(str(path)).name == "commit_success.txt" and held_at.get(str(Path(str(path)).parent)) == \
                "before_commit_success":
            hold("before_commit_success", path=str(path))
        return await write_text(path, text, *a, **k)

    async_path.write_text = write_text_hook
    state = _orbax_state()
    managers = []
    for name, (mode, point) in _ORBAX_KILLED.items():
        directory = Path(out) / name
        mngr = ocp.CheckpointManager(directory, options=_orbax_options(ocp, mode))
        for step in (1, 2):
            mngr.save(step, args=ocp.args.StandardSave(state))
            mngr.wait_until_finished()
        step_dir = directory / "3"
        held_at[str(step_dir / "default" if point == "before_item_finalize" else step_dir)] = point
        managers.append(mngr)
    for mngr in managers:
        mngr.save(3, args=ocp.args.StandardSave(state))  # returns; the commit thread holds
    threading.Event().wait()


def _orbax_main(out: Path, ctl: Path) -> dict[str, Any]:
    job = Job(ctl, "orbax-killed", _orbax_killed_job, out=str(out))
    held = job.kill_at(len(_ORBAX_KILLED))
    t0 = time.monotonic()
    import orbax.checkpoint as ocp  # only now: jax in this process would not survive a fork

    state = _orbax_state()
    for name, (kw, steps) in _ORBAX_COMPLETE.items():
        kw = dict(kw)
        with ocp.CheckpointManager(out / name, options=_orbax_options(ocp, **kw)) as mngr:
            for step in steps:
                metrics = {"loss": ORBAX_LOSSES[step]} if name == "best_fn" else None
                mngr.save(step, args=ocp.args.StandardSave(state), metrics=metrics)
                mngr.wait_until_finished()
    t_write = time.monotonic() - t0

    def read(name: str, mode: str | None, kw: dict, probe_steps: Sequence[int]) -> dict[str, Any]:
        kw = {**kw, "read_only": True}
        mngr = ocp.CheckpointManager(out / name, options=_orbax_options(ocp, mode, **kw))
        got: dict[str, Any] = {"all_steps": list(mngr.all_steps()), "latest_step": mngr.latest_step()}
        if "best" in kw:
            got["best_step"] = mngr.best_step()
        restore = {}
        for step in probe_steps:
            try:
                restored = mngr.restore(step, args=ocp.args.StandardRestore(state))
                restore[str(step)] = "ok" if float(restored["params"]["w"].sum()) == 120.0 else "wrong values"
            except Exception as exc:  # the ground truth is the exception
                restore[str(step)] = _error(exc)
        got["restore"] = restore
        mngr.close()
        return got

    runs: dict[str, Any] = {}
    records = []
    for name, (mode, point) in _ORBAX_KILLED.items():
        truth = {"writer_options": read(name, mode, {}, (1, 2, 3))}
        if mode != "atomic_rename":
            # The same directory read with default options (atomic rename on a local path): what a
            # reader that does not know the writer's mode sees.
            truth["default_options"] = read(name, None, {}, (1, 2, 3))
        runs[name] = {"mode": mode, "killed_at": point, "truth": truth, "tree": _tree(out / name)}
        step3 = out / name / ("3.orbax-checkpoint-tmp" if mode == "atomic_rename" else "3")
        meta = step3 / "_CHECKPOINT_METADATA"
        runs[name]["step3_metadata"] = json.loads(meta.read_text()) if meta.exists() else None
        listed = truth["writer_options"]["all_steps"]
        for step in (1, 2, 3):
            path = out / name / str(step) if step < 3 else step3
            records.append(_record(out, path, out / name, step, killed=point if step == 3 else None, truth={
                "ok": step in listed,
                "all_steps": step in listed,
                "all_steps_default_options": step in truth.get("default_options", truth["writer_options"])["all_steps"],
                "restore": truth["writer_options"]["restore"][str(step)],
            }))
    for name, (kw, steps) in _ORBAX_COMPLETE.items():
        truth = read(name, None, dict(kw), steps)
        runs[name] = {"options": {k: v for k, v in kw.items() if k != "best"}, "steps": list(steps),
                      "truth": truth, "tree": _tree(out / name)}
        if name == "best_fn":
            runs[name]["losses"] = ORBAX_LOSSES
        mngr_names = sorted(p.name for p in (out / name).iterdir() if p.is_dir())
        runs[name]["step_dirs"] = mngr_names
        for step, dirname in zip(steps, mngr_names, strict=True):
            records.append(_record(out, out / name / dirname, out / name, step, killed=None, truth={
                "ok": step in truth["all_steps"], "all_steps": step in truth["all_steps"],
                "restore": truth["restore"][str(step)],
            }, metric=ORBAX_LOSSES.get(step) if name == "best_fn" else None))
    return {"framework": "orbax", "versions": _versions("orbax-checkpoint", "jax"), "runs": runs,
            "checkpoints": records, "holds": held,
            "timings": {"killed_job_s": job.wall_s, "complete_write_s": t_write,
                        "complete_and_truth_s": time.monotonic() - t0}}


# --------------------------------------------------------------------------
# torch.distributed.checkpoint, named as torchtitan names it: <dump>/checkpoint/step-N/
# --------------------------------------------------------------------------

_DCP_RUNS = {
    # run -> (complete steps, killed step, where rank 0 is held)
    "titan-a": ((10, 20), 30, "before_finish"),  # every .distcp written, no .metadata
    "titan-b": ((10,), 20, "before_metadata_rename"),  # .metadata.tmp written, not renamed
}


def _dcp_state(step: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    return {"model": model.state_dict(), "train_state": {"step": torch.tensor(step)}}


def _init_gloo(rank: int, world: int) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))


def _dcp_job(rank: int, world: int, out: str, run: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem

    torch.set_num_threads(1)
    _init_gloo(rank, world)
    steps, killed, point = _DCP_RUNS[run]
    folder = Path(out) / run / "checkpoint"
    current = {"step": None}
    finish = filesystem._FileSystemWriter.finish  # the coordinator (rank 0) writes .metadata here

    def finish_hook(self, metadata, results):
        if current["step"] == killed and point == "before_finish":
            hold(point, path=str(self.path))
        return finish(self, metadata, results)

    rename = filesystem.FileSystem.rename

    def rename_hook(self, path, new_path):
        if current["step"] == killed and point == "before_metadata_rename" and Path(new_path).name == ".metadata":
            hold(point, path=str(new_path))
        return rename(self, path, new_path)

    filesystem._FileSystemWriter.finish = finish_hook
    filesystem.FileSystem.rename = rename_hook
    for step in (*steps, killed):
        current["step"] = step
        dcp.save(_dcp_state(step), checkpoint_id=str(folder / f"step-{step}"))  # torchtitan's _create_checkpoint_id
        dist.barrier()
    dist.destroy_process_group()


def _dcp_truth(rank: int, world: int, out: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    truth = {}
    for run, (steps, killed, _) in _DCP_RUNS.items():
        for step in (*steps, killed):
            path = Path(out) / run / "checkpoint" / f"step-{step}"
            template = _dcp_state(0)  # wrong values, right shapes: dcp.load fills them in place
            try:
                dcp.load(template, checkpoint_id=str(path))  # no process group: a single-process load
                expected = _dcp_state(step)
                same = all(torch.equal(template["model"][k], expected["model"][k]) for k in expected["model"])
                truth[f"{run}/{step}"] = "ok" if same and int(template["train_state"]["step"]) == step else "wrong values"
            except (Exception, CheckpointException) as exc:
                truth[f"{run}/{step}"] = _error(exc)
    write_result("truth", truth)


def _dcp_main(out: Path, ctl: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint  # noqa: F401  (once, before the forks)

    t0 = time.monotonic()
    holds = []
    for run in _DCP_RUNS:
        holds += Job(ctl, f"dcp-{run}", _dcp_job, 2, out=str(out), run=run).kill_at(1)
    t_write = time.monotonic() - t0
    truth_job = Job(ctl, "dcp-truth", _dcp_truth, 1, out=str(out))
    truth_job.join()
    truth = truth_job.results("truth")[0]
    runs, records = {}, []
    for run, (steps, killed, point) in _DCP_RUNS.items():
        folder = out / run / "checkpoint"
        # torchtitan's CheckpointManager._find_load_step (components/checkpointer/dcp.py): the highest
        # step-N holding a .metadata (or a model.safetensors.index.json) -- its rule, evaluated here
        with_metadata = [s for s in (*steps, killed) if (folder / f"step-{s}" / ".metadata").is_file()]
        runs[run] = {"steps": [*steps, killed], "killed_step": killed, "killed_at": point,
                     "torchtitan_find_load_step": max(with_metadata, default=-1), "tree": _tree(out / run)}
        for step in (*steps, killed):
            got = truth[f"{run}/{step}"]
            records.append(_record(out, folder / f"step-{step}", folder, step,
                                   killed=point if step == killed else None,
                                   truth={"ok": got == "ok", "dcp_load": got}))
    return {"framework": "dcp", "versions": _versions("torch"), "runs": runs, "checkpoints": records,
            "holds": holds, "timings": {"write_s": t_write, "truth_s": truth_job.wall_s}}


# --------------------------------------------------------------------------
# Coordinator
# --------------------------------------------------------------------------


def _versions(*dists: str) -> dict[str, str]:
    from importlib import metadata

    out = {}
    for d in dists:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[d] = metadata.version(d)
    return out


_MAINS: dict[str, Callable[[Path, Path], dict[str, Any]]] = {
    "orbax": _orbax_main,
    "dcp": _dcp_main,
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("frameworks", help=f"comma-separated: {', '.join(FRAMEWORKS)}, or all")
    p.add_argument("out")
    a = p.parse_args(argv)
    names = list(FRAMEWORKS) if a.frameworks == "all" else a.frameworks.split(",")
    for k, v in _CHILD_ENV.items():
        os.environ.setdefault(k, v)
    out = Path(a.out).resolve()
    ctl = Path(tempfile.mkdtemp(prefix="fwgen-ctl-"))
    try:
        for name in names:
            if name not in _MAINS:
                p.error(f"unknown framework {name!r}")
            t0 = time.monotonic()
            root = out / name
            root.mkdir(parents=True, exist_ok=True)
            result = _MAINS[name](root, ctl)
            result["wall_s"] = time.monotonic() - t0
            _emit("done", framework=name, result=result)
    finally:
        shutil.rmtree(ctl, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
