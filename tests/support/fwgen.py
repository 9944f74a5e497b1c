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
``python -m tests.support.fwgen FRAMEWORK OUT`` coordinator, killed as a process group on timeout)::

    from tests.support.fwgen import generate_orbax, missing
    if (why := missing("orbax")) is None:
        info = generate_orbax(tmp_path / "vol")
        info["checkpoints"]        # one record per checkpoint: path, run, step, killed, truth
        info["runs"]["commit_file"]["truth"]["all_steps"]

CLI::

    python -m tests.support.fwgen orbax OUT          # or accelerate, lightning, trainer, dcp
    python -m tests.support.fwgen all OUT            # each framework under OUT/<framework>/

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
import re
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

from tests.support import child_pythonpath, refuse_in_light_test

__all__ = [
    "EVENT_PREFIX",
    "FRAMEWORKS",
    "LIGHTNING_TINY",
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
# neither the oldest nor the newest.  The Trainer's runs log EVAL_LOSSES the same way (step -> value):
# the best is checkpoint-6, and the training loss (real, logged at the same steps) is lowest at
# checkpoint-4, so ranking by `loss` instead of `eval_loss` picks a different checkpoint.
VAL_LOSSES = (0.9, 0.4, 0.6, 0.7)
EVAL_LOSSES = {2: 0.9, 4: 0.6, 6: 0.4, 8: 0.7, 10: 0.5}
ORBAX_LOSSES = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.6}


class FwgenError(RuntimeError):
    """The coordinator failed or timed out; ``output`` holds its log."""

    def __init__(self, msg: str, output: str = ""):
        super().__init__(f"{msg}\n--- fwgen output (tail) ---\n{output[-8000:]}")
        self.output = output


# --------------------------------------------------------------------------
# Parent side (imports no framework)
# --------------------------------------------------------------------------


def run_module(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m tests.support.<module> ARGS` in the framework children's environment
    (`_CHILD_ENV`: the CPU, offline), its output captured, no stdin."""
    return subprocess.run([sys.executable, "-m", f"tests.support.{module}", *args], capture_output=True,
                          text=True, env={**os.environ, **_CHILD_ENV}, timeout=timeout, stdin=subprocess.DEVNULL)


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
    child_env["PYTHONPATH"] = child_pythonpath()
    child_env.update(env or {})
    t0 = time.monotonic()
    lines: collections.deque[str] = collections.deque(maxlen=3000)
    events: list[dict[str, Any]] = []
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.fwgen", ",".join(names), str(out)],
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
        why = "a rank exited" if not open_ or self.status else "timeout"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        self._reap(block=True)
        os.close(self._r)
        if len(held) < n_holds:
            raise RuntimeError(f"job {self.name}: {len(held)} of {n_holds} holds before {why} "
                               f"(exit codes {self.status})")
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


def _preimport(*modules: str) -> None:
    """Import in the coordinator what every job would import again: a forked job inherits it.

    torch._dynamo is among them: the first torch optimizer a process builds imports it (about 6 s on
    the 2-core box, 13 s with two ranks doing it side by side).  Importing starts no computation, so
    the forks stay safe."""
    import importlib

    for name in modules:
        importlib.import_module(name)


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
        # What the framework's own code says.  truth["complete"]: its lister counts it / its loader restores
        # everything the save meant to write; truth["loads"]: its loader runs without an error (None: not
        # tried).  A checkpoint can load and still be incomplete (a rank's RNG state silently skipped).
        "truth": truth,
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
            default_view = truth.get("default_options", truth["writer_options"])
            records.append(_record(out, path, out / name, step, killed=point if step == 3 else None, truth={
                "complete": step in listed,
                "loads": truth["writer_options"]["restore"][str(step)] == "ok",
                "all_steps": step in listed,
                "all_steps_default_options": step in default_view["all_steps"],
                "restore": truth["writer_options"]["restore"][str(step)],
                "restore_default_options": default_view["restore"][str(step)],
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
                "complete": step in truth["all_steps"], "loads": truth["restore"][str(step)] == "ok",
                "all_steps": step in truth["all_steps"], "restore": truth["restore"][str(step)],
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
                                   truth={"complete": got == "ok", "loads": got == "ok", "dcp_load": got}))
    return {"framework": "dcp", "versions": _versions("torch"), "runs": runs, "checkpoints": records,
            "holds": holds, "timings": {"write_s": t_write, "truth_s": truth_job.wall_s}}


# --------------------------------------------------------------------------
# accelerate: Accelerator.save_state, 2 processes (MULTI_CPU, gloo)
# --------------------------------------------------------------------------

# accelerate/checkpointing.py save_accelerator_state: the main process writes model.safetensors,
# optimizer.bin, scheduler.bin (and sampler/scaler when there are some), then EVERY process writes its
# random_states_<rank>.pkl; no barrier inside save_state, so rank 1's file can come first.
_ACC_KILLS = {
    # run -> (saves before the killed one, the killed save's directory, kill point)
    "auto": (3, "checkpoints/checkpoint_3", "rank0_before_optimizer"),
    "steps": (3, "step_40", "rank1_before_random_states"),
}


def _acc_setup(project_dir: Path | None = None, auto: bool = False):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    torch.set_num_threads(1)
    config = ProjectConfiguration(project_dir=str(project_dir) if project_dir else None,
                                  automatic_checkpoint_naming=auto)
    accelerator = Accelerator(cpu=True, project_config=config)
    set_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)
    gen = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=gen), torch.randn(64, 8, generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return accelerator, model, optimizer, loader, scheduler


def _acc_train(accelerator, model, optimizer, loader, scheduler, n: int) -> None:
    import torch

    batches = iter(loader)
    for _ in range(n):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _acc_job(rank: int, world: int, out: str, run: str) -> None:
    import accelerate.checkpointing as acc_ckpt
    import torch
    import torch.distributed.distributed_c10d as c10d

    auto = run == "auto"
    root = Path(out) / run
    parts = _acc_setup(root if auto else None, auto=auto)
    accelerator = parts[0]
    store = c10d._get_default_store()
    n_before, _, point = _ACC_KILLS[run]
    armed = {"on": False}
    save, torch_save = acc_ckpt.save, torch.save

    def save_hook(obj, f, *a, **k):  # model / optimizer / scheduler: called everywhere, the main process writes
        if armed["on"] and point == "rank0_before_optimizer" and rank == 0 and Path(f).name == "optimizer.bin":
            store.wait(["random_states_1"])  # rank 1 is done with this save: its file is there
            hold(point, path=str(f))
        return save(obj, f, *a, **k)

    def torch_save_hook(obj, f, *a, **k):  # checkpointing.py writes random_states_<rank>.pkl with torch.save
        name = Path(str(f)).name
        if armed["on"] and point == "rank1_before_random_states" and name == "random_states_1.pkl":
            store.wait(["random_states_0"])  # rank 0 finished every file of this save
            hold(point, path=str(f))
        torch_save(obj, f, *a, **k)
        if armed["on"] and name.startswith("random_states_"):
            store.set(name.removesuffix(".pkl"), "1")

    acc_ckpt.save = save_hook
    torch.save = torch_save_hook
    # automatic naming: checkpoints/checkpoint_<i>, from the save counter; else step_10, step_20, ...
    dirs = [None] * (n_before + 1) if auto else [root / f"step_{10 * (i + 1)}" for i in range(n_before + 1)]
    for i, target in enumerate(dirs):
        _acc_train(*parts, 4)
        armed["on"] = i == n_before
        accelerator.save_state(None if target is None else str(target))
        accelerator.wait_for_everyone()  # after the killed save: the rank that finished waits here
        if run == "steps" and i == 1:
            for epoch in (0, 1):  # accelerate's examples name per-epoch saves epoch_<N>
                accelerator.save_state(str(Path(out) / "epochs" / f"epoch_{epoch}"))
                accelerator.wait_for_everyone()
    raise AssertionError("the killed save returned")


def _acc_truth(rank: int, world: int, out: str, dirs: list[str]) -> None:
    import torch

    truth: dict[str, Any] = {}
    for rel in dirs:
        parts = _acc_setup()
        torch.manual_seed(999)
        sentinel = torch.get_rng_state()
        try:
            parts[0].load_state(str(Path(out) / rel))
            rng = "not restored (load_state went on without it)" if torch.equal(torch.get_rng_state(), sentinel) \
                else "restored"
            truth[rel] = {"load_state": "ok", "rng": rng}
        except Exception as exc:
            truth[rel] = {"load_state": _error(exc)}
    # load_state() with no directory, as a resumed job with automatic naming calls it
    accelerator = _acc_setup(Path(out) / "auto", auto=True)[0]
    picked = sorted((Path(out) / "auto" / "checkpoints").iterdir(), key=lambda p: int(p.name.split("_")[-1]))[-1]
    try:
        accelerator.load_state()
        truth["auto:load_state()"] = {"load_state": "ok", "picks": _rel(picked, Path(out))}
    except Exception as exc:
        truth["auto:load_state()"] = {"load_state": _error(exc), "picks": _rel(picked, Path(out))}
    write_result("truth", truth)


def _acc_main(out: Path, ctl: Path) -> dict[str, Any]:
    _preimport("accelerate", "accelerate.checkpointing", "torch._dynamo", "safetensors.torch")

    t0 = time.monotonic()
    holds = []
    for run in _ACC_KILLS:
        holds += Job(ctl, f"accelerate-{run}", _acc_job, 2, out=str(out), run=run).kill_at(1)
    t_write = time.monotonic() - t0
    dirs = sorted(_rel(p, out) for p in out.glob("auto/checkpoints/checkpoint_*")) + \
        sorted(_rel(p, out) for p in out.glob("steps/step_*")) + sorted(_rel(p, out) for p in out.glob("epochs/epoch_*"))
    truth_job = Job(ctl, "accelerate-truth", _acc_truth, 2, out=str(out), dirs=dirs)
    truth_job.join()
    by_rank = truth_job.results("truth")
    runs = {
        "auto": {"project_dir": "auto", "automatic_checkpoint_naming": True, "killed": _ACC_KILLS["auto"][1],
                 "killed_at": _ACC_KILLS["auto"][2], "load_state_no_dir": [r["auto:load_state()"] for r in by_rank]},
        "steps": {"killed": _ACC_KILLS["steps"][1], "killed_at": _ACC_KILLS["steps"][2]},
        "epochs": {},
    }
    records = []
    for rel in dirs:
        ranks = [r[rel] for r in by_rank]
        loads = all(r["load_state"] == "ok" for r in ranks)
        killed = next((point for run, (_, d, point) in _ACC_KILLS.items() if rel == f"{run}/{d}"), None)
        name = Path(rel).name
        records.append(_record(out, out / rel, (out / rel).parent, int(name.rsplit("_", 1)[1]), killed=killed,
                               truth={"complete": loads and all(r.get("rng") == "restored" for r in ranks),
                                      "loads": loads, "load_state": [r["load_state"] for r in ranks],
                                      "rng": [r.get("rng") for r in ranks]},
                               files=sorted(p.name for p in (out / rel).iterdir()),
                               counter=name.startswith("checkpoint_")))
    for run in runs:
        runs[run]["tree"] = _tree(out / run)
    return {"framework": "accelerate", "versions": _versions("accelerate", "torch"), "world_size": 2,
            "runs": runs, "checkpoints": records, "holds": holds,
            "timings": {"write_s": t_write, "truth_s": truth_job.wall_s}}


# --------------------------------------------------------------------------
# The Hugging Face Trainer: 2-process DDP on the CPU (gloo), a tiny GPT-2 built from a config
# --------------------------------------------------------------------------

# trainer.py Trainer._save_checkpoint: save_model (rank 0: model.safetensors, config.json,
# generation_config.json), a barrier (only when a best step is tracked), optimizer.pt + scheduler.pt
# (rank 0), rng_state_<rank>.pth (every rank), trainer_state.json (rank 0), rotate_checkpoints.
# No barrier between the rng states and trainer_state.json.
_TRAINER_KILLS = {
    "run-rng": "rank1_before_rng_state",  # rank 0 finished, trainer_state.json included
    "run-state": "rank0_before_trainer_state",  # both rng_state_<r>.pth written
}
_TRAINER_SAVE_STEPS, _TRAINER_MAX_STEPS = 2, 10  # checkpoint-2 .. -8 whole, checkpoint-10 killed


def _trainer_parts(output_dir: Path, max_steps: int, **overrides):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(5)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (48, 8), generator=gen)]
    kw = {
        "output_dir": str(output_dir), "max_steps": max_steps, "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 4, "learning_rate": 1e-3, "seed": 1234,
        "eval_strategy": "steps", "eval_steps": _TRAINER_SAVE_STEPS, "save_strategy": "steps",
        "save_steps": _TRAINER_SAVE_STEPS, "logging_steps": _TRAINER_SAVE_STEPS,
        # what a ckptd user sets: the Trainer keeps its best, ckptd does the rotating
        "metric_for_best_model": "loss", "greater_is_better": False, "load_best_model_at_end": True,
        "save_total_limit": None,
        "use_cpu": True, "ddp_backend": "gloo", "report_to": "none", "disable_tqdm": True,
        "dataloader_num_workers": 0, "log_level": "info", "log_level_replica": "info",
    }
    kw.update(overrides)

    class ChosenEvalLoss(Trainer):
        """The Trainer's own evaluation, with eval_loss replaced by EVAL_LOSSES[step] (the best is
        checkpoint-6: neither the oldest nor the newest)."""

        def evaluation_loop(self, *a, **k):
            output = super().evaluation_loop(*a, **k)
            output.metrics[f"{k.get('metric_key_prefix', 'eval')}_loss"] = EVAL_LOSSES[self.state.global_step]
            return output

    return ChosenEvalLoss(model=model, args=TrainingArguments(**kw), train_dataset=data, eval_dataset=data[:8])


def _trainer_job(rank: int, world: int, out: str, run: str) -> None:
    import torch
    import torch.distributed.distributed_c10d as c10d
    import transformers.trainer_callback as trainer_callback

    point = _TRAINER_KILLS[run]
    killed = f"checkpoint-{_TRAINER_MAX_STEPS}"
    trainer = _trainer_parts(Path(out) / run, _TRAINER_MAX_STEPS)
    store = c10d._get_default_store()
    torch_save, save_to_json = torch.save, trainer_callback.TrainerState.save_to_json

    def torch_save_hook(obj, f, *a, **k):
        path = Path(str(f))
        if path.parent.name == killed and path.name == "rng_state_1.pth" and point == "rank1_before_rng_state":
            store.wait(["trainer_state"])  # rank 0 has written trainer_state.json
            hold(point, path=str(path))
        torch_save(obj, f, *a, **k)
        if path.parent.name == killed and path.name == "rng_state_1.pth":
            store.set("rng_state_1", "1")

    def save_to_json_hook(self, json_path):
        path = Path(json_path)
        if path.parent.name == killed and point == "rank0_before_trainer_state":
            store.wait(["rng_state_1"])  # rank 1 has written its rng state
            hold(point, path=str(path))
        save_to_json(self, json_path)
        if path.parent.name == killed:
            store.set("trainer_state", "1")

    torch.save = torch_save_hook
    trainer_callback.TrainerState.save_to_json = save_to_json_hook
    trainer.train()
    threading.Event().wait()  # the rank that was not held: wait here for the kill


def _trainer_truth(rank: int, world: int, out: str, scratch: str) -> None:
    import logging

    import torch.distributed as dist
    from transformers import TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint

    messages: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            if "RNG file" in record.getMessage():
                messages.append(record.getMessage())

    logging.getLogger("transformers.trainer").addHandler(Capture())

    class CountSteps(TrainerCallback):
        def __init__(self):
            self.steps = 0

        def on_step_end(self, args, state, control, **kw):
            self.steps += 1

    truth: dict[str, Any] = {}
    targets = [(run, None) for run in _TRAINER_KILLS] + [("run-rng", f"checkpoint-{_TRAINER_MAX_STEPS - 2}")]
    for run, name in targets:
        last = get_last_checkpoint(str(Path(out) / run))  # what resume_from_checkpoint=True resumes from
        path = last if name is None else str(Path(out) / run / name)
        key = f"{run}:{'get_last_checkpoint' if name is None else name}"
        messages.clear()
        counter = CountSteps()
        # the volume stays untouched: the resumed run writes nowhere near it
        trainer = _trainer_parts(Path(scratch) / f"{run}-r{rank}", _TRAINER_MAX_STEPS + 2, save_strategy="no",
                                 eval_strategy="no", load_best_model_at_end=False)
        trainer.add_callback(counter)
        entry: dict[str, Any] = {"get_last_checkpoint": _rel(last, Path(out)) if last else None,
                                 "resumed_from": _rel(path, Path(out))}
        try:
            trainer.train(resume_from_checkpoint=path)
            entry.update(resume="ok", steps_run=counter.steps,
                         started_at=trainer.state.global_step - counter.steps, rng_messages=list(messages))
        except Exception as exc:
            entry.update(resume=_error(exc))
        truth[key] = entry
        dist.barrier()  # both ranks finish this resume before the next (its failure may be on one rank only)
    write_result("truth", truth)


def _trainer_main(out: Path, ctl: Path) -> dict[str, Any]:
    _preimport("transformers", "transformers.trainer", "transformers.models.gpt2.modeling_gpt2", "torch._dynamo",
               "accelerate", "safetensors.torch")
    t0 = time.monotonic()
    holds = []
    for run in _TRAINER_KILLS:
        holds += Job(ctl, f"trainer-{run}", _trainer_job, 2, out=str(out), run=run).kill_at(1)
    t_write = time.monotonic() - t0
    scratch = ctl / "trainer-resume"
    truth_job = Job(ctl, "trainer-truth", _trainer_truth, 2, out=str(out), scratch=str(scratch))
    truth_job.join()
    by_rank = truth_job.results("truth")
    runs, records = {}, []
    for run, point in _TRAINER_KILLS.items():
        runs[run] = {"killed": f"checkpoint-{_TRAINER_MAX_STEPS}", "killed_at": point,
                     "resume_from_last": [r[f"{run}:get_last_checkpoint"] for r in by_rank], "tree": _tree(out / run)}
        for step in range(_TRAINER_SAVE_STEPS, _TRAINER_MAX_STEPS + 1, _TRAINER_SAVE_STEPS):
            path = out / run / f"checkpoint-{step}"
            state_file = path / "trainer_state.json"
            state = json.loads(state_file.read_text()) if state_file.exists() else None
            killed = point if step == _TRAINER_MAX_STEPS else None
            if killed:
                resumed = [r[f"{run}:get_last_checkpoint"] for r in by_rank]
                truth = {"complete": False, "loads": all(r["resume"] == "ok" for r in resumed),
                         "get_last_checkpoint_picks_it": all(r["get_last_checkpoint"] == _rel(path, out) for r in resumed),
                    "resume": [r["resume"] for r in resumed], "started_at": [r.get("started_at") for r in resumed],
                    "rng_messages": [r.get("rng_messages") for r in resumed]}
            else:
                truth = {"complete": True, "loads": None}  # the save finished; resumed from only where tried
                if run == "run-rng" and step == _TRAINER_MAX_STEPS - 2:
                    resumed = [r[f"run-rng:checkpoint-{step}"] for r in by_rank]
                    truth.update(resume=[r["resume"] for r in resumed], started_at=[r.get("started_at") for r in resumed],
                                 rng_messages=[r.get("rng_messages") for r in resumed])
                    truth["loads"] = all(r["resume"] == "ok" and r["started_at"] == step for r in resumed)
                    truth["complete"] = truth["loads"] and not any(r.get("rng_messages") for r in resumed)
            records.append(_record(out, path, out / run, step, killed=killed, truth=truth,
                                   metric=EVAL_LOSSES[step], files=sorted(p.name for p in path.iterdir()),
                                   best_model_checkpoint=state and state.get("best_model_checkpoint"),
                                   best_metric=state and state.get("best_metric")))
    return {"framework": "trainer", "versions": _versions("transformers", "torch", "accelerate"), "world_size": 2,
            "eval_losses": EVAL_LOSSES, "runs": runs, "checkpoints": records, "holds": holds,
            "timings": {"write_s": t_write, "truth_s": truth_job.wall_s}}


# --------------------------------------------------------------------------
# Lightning: ModelCheckpoint in the default tree <run>/lightning_logs/version_0/checkpoints/
# --------------------------------------------------------------------------

# lightning/fabric/utilities/cloud_io.py _atomic_save: torch.save into a BytesIO, then inside an
# fsspec transaction `fs.open(path, "wb")`; fsspec's LocalFileOpener (autocommit=False) writes a
# tempfile.mkstemp() file in TMPDIR and commit() does shutil.move(temp, path).  On the same
# filesystem that is a rename (atomic); across filesystems shutil.move copies INTO the final name.
_LIGHTNING_RUNS = {
    # run -> (ModelCheckpoint filename template or None for the default, kill point or None)
    "team-a/run-default": (None, None),
    "team-a/run-metric": ("{epoch}-{step}-{val_loss:.2f}", None),
    "team-b/run-nostep": ("{epoch}-{val_loss:.2f}", None),
    "team-b/run-killed": (None, "before_commit"),  # TMPDIR on the checkpoints' filesystem
    "team-c/run-xdev-topk": (None, "mid_copy_topk"),  # TMPDIR elsewhere: killed half-way into epoch=2-...ckpt
    "team-c/run-xdev-last": (None, "mid_copy_last"),  # TMPDIR elsewhere: killed half-way into rewriting last.ckpt
}
_LIGHTNING_KILL_EPOCH = 2
_LIGHTNING_BATCHES = 2  # training batches per epoch: epoch E ends at step 2 * (E + 1)


# The head of a test's own Lightning script (`python -c`, the fit in a child of its own: tests/
# attestation/test_attest_lightning.py, tests/discovery/test_lightning_runs.py): `sys`, `torch`, `pl`,
# a tiny model `Tiny` (Linear 16 -> 8, MSE loss, AdamW) and its 8 samples `data`; the script goes on
# with its own callbacks and Trainer.
LIGHTNING_TINY = """
import sys, torch
import lightning.pytorch as pl
torch.set_num_threads(1)
class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.layer = torch.nn.Linear(16, 8)
    def training_step(self, batch, i):
        x, y = batch; return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(8, 16), torch.randn(8, 8))
"""


def _ckpt_dir(out: Path, run: str) -> Path:
    return out / run / "lightning_logs" / "version_0" / "checkpoints"


def _lightning_fit(out: Path, run: str, max_epochs: int, ckpt_path: str | None = None, root: Path | None = None):
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.set_num_threads(1)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(16, 8)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def validation_step(self, batch, batch_idx):
            # the logged val_loss is chosen (VAL_LOSSES), so the best epoch is known: 1
            self.log("val_loss", VAL_LOSSES[min(self.current_epoch, len(VAL_LOSSES) - 1)])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    template, _ = _LIGHTNING_RUNS.get(run, (None, None))
    kw = {"filename": template} if template else {}
    checkpoint = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=-1, save_last=True, **kw)
    pl.seed_everything(1234, verbose=False)
    trainer = pl.Trainer(default_root_dir=str(root or out / run), max_epochs=max_epochs, accelerator="cpu",
                         devices=1, callbacks=[checkpoint], enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, log_every_n_steps=1, limit_train_batches=_LIGHTNING_BATCHES)
    trainer.fit(Tiny(), loader, loader, ckpt_path=ckpt_path)
    return trainer


def _other_filesystem(path: Path) -> Path | None:
    """A writable directory on another filesystem than ``path`` (for Lightning's cross-device save)."""
    dev = path.stat().st_dev
    for candidate in ("/dev/shm", "/run", "/var/tmp", "/tmp"):
        c = Path(candidate)
        with contextlib.suppress(OSError):
            if c.is_dir() and os.access(c, os.W_OK) and c.stat().st_dev != dev:
                return c
    return None


def _lightning_complete_job(rank: int, world: int, out: str) -> None:
    for run, (_, point) in _LIGHTNING_RUNS.items():
        if point is None:
            _lightning_fit(Path(out), run, len(VAL_LOSSES))


def _lightning_killed_job(rank: int, world: int, out: str, run: str, tmp: str) -> None:
    import tempfile as tempfile_mod

    from fsspec.implementations.local import LocalFileOpener

    _, point = _LIGHTNING_RUNS[run]
    tempfile_mod.tempdir = tmp  # where fsspec's LocalFileOpener stages the file (tempfile.mkstemp)
    # the file to kill the writer in: this epoch's top-k file, or last.ckpt when this epoch rewrites it
    step = _LIGHTNING_BATCHES * (_LIGHTNING_KILL_EPOCH + 1)
    name = "last.ckpt" if point == "mid_copy_last" else f"epoch={_LIGHTNING_KILL_EPOCH}-step={step}.ckpt"
    seen = collections.Counter()

    def is_target(path: str) -> bool:
        if Path(path).name != name:
            return False
        seen[path] += 1
        return seen[path] == (_LIGHTNING_KILL_EPOCH + 1 if name == "last.ckpt" else 1)  # last.ckpt: once an epoch

    commit = LocalFileOpener.commit

    def commit_hook(self):
        if point == "before_commit" and is_target(self.path):
            hold(point, path=self.path, temp=self.temp)
        return commit(self)

    sendfile = shutil._fastcopy_sendfile  # shutil.copyfile's copy loop on Linux, reached from shutil.move

    def sendfile_hook(fsrc, fdst):
        if point.startswith("mid_copy") and is_target(fdst.name):
            size = os.fstat(fsrc.fileno()).st_size
            os.sendfile(fdst.fileno(), fsrc.fileno(), 0, size // 2)  # the first half, as the real loop does
            fdst.flush()
            hold(point, path=fdst.name, written=size // 2, size=size)
        return sendfile(fsrc, fdst)

    LocalFileOpener.commit = commit_hook
    shutil._fastcopy_sendfile = sendfile_hook
    _lightning_fit(Path(out), run, len(VAL_LOSSES))
    raise AssertionError("the killed save returned")


def _describe_lightning_ckpt(ckpt: dict[str, Any]) -> dict[str, Any]:
    import torch

    def kind(v):
        if isinstance(v, torch.Tensor):
            return f"Tensor(shape={tuple(v.shape)}, dtype={str(v.dtype).removeprefix('torch.')})"
        return type(v).__name__

    callbacks = ckpt.get("callbacks", {})
    state_key = next((k for k in callbacks if k.startswith("ModelCheckpoint")), None)
    mc = callbacks.get(state_key, {})
    value = lambda v: float(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {
        "keys": sorted(ckpt), "epoch": ckpt.get("epoch"), "global_step": ckpt.get("global_step"),
        "callbacks_keys": sorted(callbacks), "model_checkpoint_key": state_key,
        "model_checkpoint": {k: value(v) for k, v in mc.items() if k != "best_k_models"},
        "model_checkpoint_types": {k: kind(v) for k, v in mc.items()},
        "best_k_models": {Path(k).name: value(v) for k, v in mc.get("best_k_models", {}).items()},
    }


def _lightning_truth(rank: int, world: int, out: str, scratch: str, resume: list[str]) -> None:
    import torch

    truth: dict[str, Any] = {}
    for path in sorted(Path(out).rglob("*.ckpt")):
        rel = _rel(path, Path(out))
        entry: dict[str, Any] = {"size": path.stat().st_size}
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            entry.update(weights_only_mmap="ok", **_describe_lightning_ckpt(ckpt))
        except Exception as exc:
            entry["weights_only_mmap"] = _error(exc)
        if rel in resume:
            run = next(r for r in _LIGHTNING_RUNS if rel.startswith(r + "/"))
            try:
                trainer = _lightning_fit(Path(out), run, len(VAL_LOSSES) + 1, ckpt_path=str(path),
                                         root=Path(scratch) / rel.replace("/", "_"))
                entry["resume"] = "ok"
                entry["resumed_epochs"] = trainer.current_epoch
            except Exception as exc:
                entry["resume"] = _error(exc)
        truth[rel] = entry
    write_result("truth", truth)


def _lightning_main(out: Path, ctl: Path) -> dict[str, Any]:
    _preimport("lightning.pytorch", "lightning.pytorch.callbacks", "torch._dynamo", "fsspec.implementations.local")
    t0 = time.monotonic()
    Job(ctl, "lightning-complete", _lightning_complete_job, 1, out=str(out)).join()
    t_complete = time.monotonic() - t0
    other = _other_filesystem(out)
    same = ctl if ctl.stat().st_dev == out.stat().st_dev else Path(tempfile.mkdtemp(prefix=".fwgen-", dir=out))
    holds, skipped = [], {}
    for run, (_, point) in _LIGHTNING_RUNS.items():
        if point is None:
            continue
        if point.startswith("mid_copy") and other is None:
            skipped[run] = "no writable directory on another filesystem than the volume"
            continue
        tmp = Path(tempfile.mkdtemp(prefix="fwgen-", dir=other if point.startswith("mid_copy") else same))
        try:
            holds += Job(ctl, f"lightning-{run.replace('/', '-')}", _lightning_killed_job, 1, out=str(out),
                         run=run, tmp=str(tmp)).kill_at(1)
            staged = sorted(p.name for p in tmp.iterdir())
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        holds[-1]["staged_in_tmpdir"] = staged
    if same != ctl:
        shutil.rmtree(same, ignore_errors=True)
    t_write = time.monotonic() - t0
    resume = []
    for run, (_, point) in _LIGHTNING_RUNS.items():
        d = _ckpt_dir(out, run)
        if point is not None and run not in skipped:
            step = _LIGHTNING_BATCHES * (_LIGHTNING_KILL_EPOCH + 1)
            resume += [_rel(d / "last.ckpt", out), _rel(d / f"epoch={_LIGHTNING_KILL_EPOCH}-step={step}.ckpt", out)]
    resume.append(_rel(_ckpt_dir(out, "team-a/run-default") / "last.ckpt", out))
    truth_job = Job(ctl, "lightning-truth", _lightning_truth, 1, out=str(out), scratch=str(ctl / "lightning-resume"),
                    resume=resume)
    truth_job.join()
    truth = truth_job.results("truth")[0]
    runs, records = {}, []
    for run, (template, point) in _LIGHTNING_RUNS.items():
        if run in skipped:
            runs[run] = {"skipped": skipped[run]}
            continue
        d = _ckpt_dir(out, run)
        runs[run] = {"filename": template, "killed_at": point, "ckpt_dir": _rel(d, out), "tree": _tree(out / run),
                     "files": sorted(p.name for p in d.iterdir())}
        for path in sorted(d.glob("*.ckpt")):
            rel = _rel(path, out)
            t = truth[rel]
            loads = t["weights_only_mmap"] == "ok" and t.get("resume", "ok") == "ok"
            hold_here = next((h for h in holds if Path(h.get("path", "")).resolve() == path.resolve()), None)
            killed = point if hold_here is not None else None
            # the global step: from the file when it loads, else from a step=N in its name
            step = t.get("global_step")
            if step is None and (m := re.search(r"(?:^|-)step=(\d+)", path.name)):
                step = int(m[1])
            epoch = t.get("epoch")
            records.append(_record(out, path, d, step, killed=killed,
                                   truth={"complete": loads, "loads": loads, **t},
                                   epoch=epoch, metric=VAL_LOSSES[epoch] if isinstance(epoch, int) and
                                   epoch < len(VAL_LOSSES) else None, last=path.name.startswith("last")))
    return {"framework": "lightning", "versions": _versions("lightning", "torch", "fsspec"),
            "val_losses": list(VAL_LOSSES), "other_filesystem": str(other) if other else None, "runs": runs,
            "checkpoints": records, "holds": holds,
            "timings": {"complete_s": t_complete, "write_s": t_write, "truth_s": truth_job.wall_s}}


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
    "accelerate": _acc_main,
    "trainer": _trainer_main,
    "lightning": _lightning_main,
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("frameworks", help=f"comma-separated: {', '.join(FRAMEWORKS)}, or all")
    p.add_argument("out")
    a = p.parse_args(argv)
    names = list(FRAMEWORKS) if a.frameworks == "all" else a.frameworks.split(",")
    # Orbax last: this process imports jax for it, and nothing may be forked after jax started.
    names.sort(key=lambda n: n == "orbax")
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
    refuse_in_light_test("a framework's own save (tests/support/fwgen.py)")
    sys.exit(main())
