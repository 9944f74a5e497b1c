"""Consolidating a DeepSpeed checkpoint's weights with DeepSpeed's own zero_to_fp32.

Before slimming removes a ZeRO checkpoint's optimizer shards, the fp32 weights
that live only in them are written to `model.safetensors`. `consolidate()` runs
`python -m ckptd.consolidate` as a subprocess at low priority (nice 19, and
`ionice` best-effort 7 where there is one): it needs torch, deepspeed and the
memory of the whole fp32 model, none of which belongs in the daemon. The child:

1. reconstructs the fp32 state dict with
   `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`,
   whose `torch.load(weights_only=False)` is replaced by `weights_only=True`
   with exactly the three DeepSpeed classes a shard needs allow-listed
   (`dsmeta.optimizer_safe_globals`): a shard on a shared volume must not run code;
2. checks names and shapes against the model-states file's `param_shapes`;
3. writes the temp file with `safetensors.torch.save_file` (its own writer:
   DeepSpeed's `convert_zero_checkpoint_to_state_dict` would want
   huggingface_hub for sharding), fsyncs it;
4. reads it back with safetensors and compares every tensor byte for byte,
   then hashes it (sha256).

The parent checks the result again on its own (the header's names and shapes
against `param_shapes`, its size) before the reaper renames it into place.
Without CUDA in the picture: `DS_ACCELERATOR=cpu`, so a training GPU is never touched.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptd import dsmeta
from ckptd.config import format_duration
from ckptd.evidence import safetensors_problem

PARENT_ENV = "CKPTD_CONSOLIDATE_PARENT"  # the parent's pid: the child dies with it

# Test hook: the child announces its pid on this FIFO once the temp file is written,
# then waits (SIGUSR1 or 60 s) so that a test can kill it midway.
PAUSE_FIFO_ENV = "CKPTD_TEST_CONSOLIDATE_FIFO"


class ConsolidationFailed(Exception):
    """zero_to_fp32 failed, or its output did not verify. Nothing was removed."""


@dataclass(frozen=True)
class Consolidated:
    path: Path  # the verified output, still under its temp name
    sha256: str
    bytes: int
    tensors: int
    seconds: float
    tool: str  # e.g. "deepspeed.utils.zero_to_fp32 (deepspeed 0.19.8)"


def consolidate(
    save_dir: Path,
    tag: str,
    model_states: Path,
    out: Path,
    *,
    timeout: float | None = None,
) -> Consolidated:
    """Consolidate `save_dir/tag` into `out` in a low-priority subprocess, and check the result."""
    cmd = [sys.executable, "-m", "ckptd.consolidate", str(save_dir), tag, str(model_states), str(out)]
    ionice = shutil.which("ionice")
    if ionice:  # best effort, lowest level; -t: run anyway where ioprio_set is not allowed
        cmd = [ionice, "-t", "-c", "2", "-n", "7", *cmd]
    # The child imports this very ckptd, wherever it was imported from.
    here = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "DS_ACCELERATOR": "cpu", "TQDM_DISABLE": "1"}
    env[PARENT_ENV] = str(os.getpid())
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        assert timeout is not None  # subprocess.run has killed it (SIGKILL) and reaped it
        raise ConsolidationFailed(f"zero_to_fp32 took longer than {format_duration(timeout)}") from None
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        why = lines[-1] if lines else "no output"
        if proc.returncode < 0:
            why = f"killed by signal {-proc.returncode} ({why})"
        raise ConsolidationFailed(why)
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise ConsolidationFailed(f"no result from the consolidator: {proc.stdout[-200:]!r}") from None
    problem = check_output(out, model_states, result.get("bytes"))
    if problem:
        raise ConsolidationFailed(problem)
    return Consolidated(out, result["sha256"], result["bytes"], result["tensors"], seconds, result["tool"])


def check_output(out: Path, model_states: Path, size: object) -> str | None:
    """The parent's own check of the consolidated file; None if it passes."""
    try:
        actual = os.stat(out).st_size
        if actual != size:
            return f"{out.name} is {actual} bytes, the consolidator wrote {size}"
        problem = safetensors_problem(out, actual)
        if problem:
            return f"{out.name}: {problem}"
        header = read_safetensors_header(out)
        expected = dsmeta.expected_tensors(model_states)
    except (OSError, ValueError, dsmeta.MetadataUnavailable) as exc:
        return f"cannot check {out.name}: {exc}"
    return compare(expected, {k: tuple(v["shape"]) for k, v in header.items()})


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensors: name -> {"dtype", "shape", "data_offsets"}."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def compare(expected: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]]) -> str | None:
    """Why the tensor names and shapes differ from the model-states file's, or None."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(expected) & set(got) if tuple(expected[k]) != tuple(got[k]))
    if not (missing or extra or wrong):
        return None
    parts = []
    if missing:
        parts.append(f"missing {', '.join(missing[:3])}")
    if extra:
        parts.append(f"unexpected {', '.join(extra[:3])}")
    if wrong:
        k = wrong[0]
        parts.append(f"{k} has shape {list(got[k])}, param_shapes says {list(expected[k])}")
    return "consolidated tensors do not match param_shapes: " + "; ".join(parts)


# --- the child -----------------------------------------------------------


def _run(save_dir: str, tag: str, model_states: Path, out: Path) -> dict:
    import deepspeed
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    expected = dsmeta.expected_tensors(model_states)
    allowed = dsmeta.optimizer_safe_globals()
    unsafe_load = torch.load

    def safe_load(f, map_location=None, *args, weights_only=None, **kwargs):
        # zero_to_fp32 asks for weights_only=False; it gets the safe loader and three classes.
        with torch.serialization.safe_globals(allowed):
            return unsafe_load(f, map_location, *args, weights_only=True, **kwargs)

    torch.load = safe_load
    from deepspeed.utils import zero_to_fp32

    with contextlib.redirect_stdout(sys.stderr):  # it prints progress; stdout carries our result
        sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
    problem = compare(expected, {k: tuple(v.shape) for k, v in sd.items()})
    if problem:
        raise ValueError(problem)
    save_file(_untie(sd), str(out), metadata={"format": "pt", "ckptd": f"zero_to_fp32 of {tag}"})
    # save_file creates it 0600: readable like the checkpoint it came from instead.
    os.chmod(out, stat.S_IMODE(os.stat(model_states).st_mode))
    with open(out, "rb") as f:
        os.fsync(f.fileno())
    _pause_for_tests()

    with safe_open(str(out), framework="pt") as f:
        names = set(f.keys())
        if names != set(sd):
            raise ValueError(f"read back {len(names)} tensors, wrote {len(sd)}")
        for name in names:
            t = f.get_tensor(name)
            if t.dtype != sd[name].dtype or not _same_bytes(torch, t, sd[name]):
                raise ValueError(f"{name} reads back different from what was written")
    h = hashlib.sha256()
    with open(out, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return {
        "sha256": h.hexdigest(),
        "bytes": os.stat(out).st_size,
        "tensors": len(sd),
        "tool": f"deepspeed.utils.zero_to_fp32 (deepspeed {deepspeed.__version__})",
    }


def _untie(sd: dict) -> dict:
    """Copies of tensors that share storage: save_file refuses shared tensors.

    ZeRO-2 reconstructs every parameter as a view into one flat fp32 vector, and
    tied weights (`shared_params`) are the same tensor under two names.
    """
    seen: set[int] = set()
    out = {}
    for name, t in sd.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and ptr != 0 else t
        seen.add(ptr)
    return out


def _same_bytes(torch, a, b) -> bool:
    """Bitwise equality: NaN weights are weights too."""
    if a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _die_with_parent() -> None:
    """SIGKILL this process when the ckptd that started it exits, however it exits: a daemon
    stopped mid-consolidation (or killed) leaves no zero_to_fp32 writing on its own.
    Linux only (PR_SET_PDEATHSIG); elsewhere the consolidation runs on to its end."""
    parent = os.environ.get(PARENT_ENV)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if parent and os.getppid() != int(parent):  # it exited before the line above
        os._exit(1)


def _pause_for_tests() -> None:
    fifo = os.environ.get(PAUSE_FIFO_ENV)
    if not fifo:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO if no test is listening: fail, never hang
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)
    signal.sigtimedwait({signal.SIGUSR1}, 60)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptd.consolidate", description=__doc__.splitlines()[0])
    p.add_argument("save_dir", help="the directory holding global_step<N>/")
    p.add_argument("tag", help="global_step<N>")
    p.add_argument("model_states", type=Path, help="its model-states file, for param_shapes")
    p.add_argument("out", type=Path, help="the safetensors file to write")
    args = p.parse_args(argv)
    _die_with_parent()
    with contextlib.suppress(OSError):
        os.nice(19)
    try:
        result = _run(args.save_dir, args.tag, args.model_states, args.out)
    except Exception as exc:  # torch and deepspeed raise many kinds; the parent reads the last line
        print(
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
