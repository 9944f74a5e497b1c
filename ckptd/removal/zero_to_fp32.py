"""Consolidating a DeepSpeed checkpoint's fp32 weights with DeepSpeed's own zero_to_fp32.

Before slimming removes a ZeRO checkpoint's optimizer shards, the fp32 weights that
live only in them are written out as sharded safetensors with an index, the way the
HF ecosystem reads them (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`).
`Consolidation` runs `python -m ckptd.removal.zero_to_fp32` as a subprocess at low priority (nice 19,
and `ionice` best-effort 7 where there is one): it needs torch and deepspeed, none of which
belongs in the daemon. The child:

1. reconstructs the fp32 state dict with
   `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)`,
   whose `torch.load(weights_only=False)` is replaced by `weights_only=True` with exactly the
   three DeepSpeed classes a shard needs allow-listed (`dsmeta.optimizer_safe_globals`), and
   memory-mapped (`mmap=True`): a shard on a shared volume must not run code, and the
   optimizer moments and the 16-bit module in the model states are never read into memory;
2. checks names and shapes against the model-states file's `param_shapes`;
3. writes each shard by streaming, one tensor materialised at a time (`Writer`), fsyncs it;
4. reads each shard back through safetensors itself and compares every tensor, byte for
   byte, with the same tensor gathered again from the DeepSpeed shards, then hashes the
   file (sha256);
5. writes the index, whose metadata records the source, a fingerprint of the shards it was
   consolidated from, and each shard's size and hash (`slim.INDEX_RECORD`).

Memory (`bench/consolidation.py` measures it): lazy mode alone bounds ZeRO-3 only; at
ZeRO-2, zero_to_fp32 concatenates every rank's fp32 partition into one vector (the whole
model) before slicing parameters out of it. Its own merge function is run with a `torch`
whose `cat` returns that concatenation unmaterialised (`_LazyCat`): DeepSpeed's offsets,
paddings and sanity checks run unchanged, and each parameter is gathered from the
partitions only when it is written. The mapped pages of the shards stay resident until
unmapped, so the state dict is rebuilt (the old one dropped) after every `REMAP_BYTES`.
A parameter split across ranks is written and compared piece by piece (`_chunks`), never
concatenated. Peak RSS: the interpreter with torch and deepspeed, plus `REMAP_BYTES` of
mapped source pages and `REOPEN_BYTES` of the shard read back, plus about twice the largest
tensor (its pages in the shards and in the file read back); not the model, not the shard size.

The parent checks the result again on its own (every header's names and shapes against
`param_shapes`, sizes, the index) before the reaper moves it into place.
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
import threading
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.formatting import format_duration
from ckptd.frameworks import dsmeta
from ckptd.judge import slim
from ckptd.judge.weights import read_header
from ckptd.judge.wholefile import safetensors_problem

PARENT_ENV = "CKPTD_CONSOLIDATE_PARENT"  # the parent's pid: the child dies with it

# Test hook: the child announces its pid on this FIFO once its first shard is written (before
# it is verified), then waits (SIGUSR1 or 60 s) so that a test can act while it runs.
PAUSE_FIFO_ENV = "CKPTD_TEST_CONSOLIDATE_FIFO"

# Output shards of at most this much (one larger tensor goes alone), as DeepSpeed's own converter
# and transformers 4 cut them. Memory does not grow with it: tensors are streamed, and the
# mappings that hold read pages are dropped every REMAP_BYTES (writing) and REOPEN_BYTES (reading back).
MAX_SHARD_BYTES = 5 * 1000**3
REMAP_BYTES = 128 << 20
REOPEN_BYTES = 128 << 20


class ConsolidationFailed(Exception):
    """zero_to_fp32 failed, was stopped, or its output did not verify. Nothing was removed."""


@dataclass(frozen=True)
class Consolidated:
    """Verified output in its work directory, not yet moved into the checkpoint."""

    path: Path  # the work directory: the shards and the index
    files: tuple[tuple[str, int, str], ...]  # (shard file name, bytes, sha256)
    index_bytes: int
    index_sha256: str  # of the index, which holds every shard's sha256
    tensors: int
    seconds: float
    tool: str  # e.g. "deepspeed.utils.zero_to_fp32 (deepspeed 0.19.8)"
    # (dev, inode, size, mtime_ns) of each file as the parent checked it: what may be moved into place
    identities: dict[str, tuple[int, int, int, int]] = field(default_factory=dict, compare=False)

    @property
    def bytes(self) -> int:
        return sum(size for _, size, _ in self.files)


class Consolidation:
    """One zero_to_fp32 run into `out_dir` (an empty directory), in a low-priority subprocess.

    `run` blocks until it is done and checked; `cancel`, from any thread, kills the child
    (a daemon stopping, or a checkpoint no longer to be slimmed) and `run` raises.
    """

    def __init__(
        self,
        save_dir: Path,
        tag: str,
        model_states: Path,
        out_dir: Path,
        *,
        source_fingerprint: str,
        timeout: float | None = None,
        max_shard_bytes: int = MAX_SHARD_BYTES,
    ):
        self.args = [str(save_dir), tag, str(model_states), str(out_dir)]
        self.args += ["--source-fingerprint", source_fingerprint, "--max-shard-bytes", str(max_shard_bytes)]
        self.out_dir = out_dir
        self.model_states = model_states
        self.timeout = timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._cancelled: str | None = None

    def cancel(self, why: str = "cancelled") -> None:
        with self._lock:
            self._cancelled = self._cancelled or why
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()

    def run(self) -> Consolidated:
        cmd = [sys.executable, "-m", "ckptd.removal.zero_to_fp32", *self.args]
        ionice = shutil.which("ionice")
        if ionice:  # best effort, lowest level; -t: run anyway where ioprio_set is not allowed
            cmd = [ionice, "-t", "-c", "2", "-n", "7", *cmd]
        # The child imports this very ckptd, wherever it was imported from.
        here = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "DS_ACCELERATOR": "cpu", "TQDM_DISABLE": "1"}
        env[PARENT_ENV] = str(os.getpid())
        start = time.monotonic()
        with self._lock:
            if self._cancelled:
                raise ConsolidationFailed(self._cancelled)
            # PR_SET_PDEATHSIG in the child fires when the *thread* that started it exits: the
            # caller's thread waits here until the child is gone, so that is the process's exit.
            proc = self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        try:
            out, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            assert self.timeout is not None
            raise ConsolidationFailed(
                f"zero_to_fp32 took longer than {format_duration(self.timeout)}"
            ) from None
        seconds = time.monotonic() - start
        if self._cancelled:
            raise ConsolidationFailed(self._cancelled)
        if proc.returncode != 0:
            lines = err.strip().splitlines()
            why = lines[-1] if lines else "no output"
            if proc.returncode < 0:
                why = f"killed by signal {-proc.returncode} ({why})"
            raise ConsolidationFailed(why)
        try:
            result = json.loads(out.strip().splitlines()[-1])
        except (IndexError, ValueError):
            raise ConsolidationFailed(f"no result from the consolidator: {out[-200:]!r}") from None
        return check_output(self.out_dir, self.model_states, result, seconds)


def consolidate(
    save_dir: Path,
    tag: str,
    model_states: Path,
    out_dir: Path,
    *,
    source_fingerprint: str,
    timeout: float | None = None,
) -> Consolidated:
    """Consolidate `save_dir/tag` into `out_dir` and check the result (blocking)."""
    return Consolidation(
        save_dir, tag, model_states, out_dir, source_fingerprint=source_fingerprint, timeout=timeout
    ).run()


def check_output(out_dir: Path, model_states: Path, result: dict, seconds: float = 0.0) -> Consolidated:
    """The parent's own check of what the child reports it wrote. Raises ConsolidationFailed."""
    try:
        files = [(str(f["path"]), int(f["bytes"]), str(f["sha256"])) for f in result["files"]]
        index = result["index"]
        names = [name for name, _, _ in files]
        if index["path"] != slim.INDEX or names != [
            slim.shard_name(i, len(files)) for i in range(1, len(files) + 1)
        ]:
            raise ValueError(f"unexpected file names {names} + {index['path']}")
        there = sorted(os.listdir(out_dir))
        if there != sorted([*names, slim.INDEX]):
            raise ValueError(f"{out_dir.name} holds {there}, not the {len(files)} shards and the index")
        identities: dict[str, tuple[int, int, int, int]] = {}
        got: dict[str, tuple[int, ...]] = {}
        weight_map: dict[str, str] = {}
        total = 0
        for name, size, _ in [*files, (slim.INDEX, index["bytes"], "")]:
            st = os.lstat(out_dir / name)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise ValueError(
                    f"{name} is {st.st_size} bytes (or not a file), the consolidator wrote {size}"
                )
            identities[name] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if name == slim.INDEX:
                continue
            problem = safetensors_problem(out_dir / name, size)
            if problem:
                raise ValueError(f"{name}: {problem}")
            for tensor, info in read_header(out_dir / name).items():
                if tensor in got:
                    raise ValueError(f"{tensor} is in two shards")
                got[tensor] = tuple(info["shape"])
                weight_map[tensor] = name
                total += info["data_offsets"][1] - info["data_offsets"][0]
        expected = dsmeta.expected_tensors(model_states)
        with open(out_dir / slim.INDEX, "rb") as f:
            written = json.loads(f.read())
        record = written["metadata"][slim.INDEX_RECORD]
        recorded = [(f["path"], f["bytes"], f["sha256"]) for f in record["files"]]
    except (OSError, ValueError, KeyError, TypeError, dsmeta.MetadataUnavailable) as exc:
        raise ConsolidationFailed(f"cannot check the consolidated weights: {exc}") from None
    problem = compare(expected, got)
    if problem is None and written["weight_map"] != weight_map:
        problem = f"{slim.INDEX}'s weight_map does not match the shards' headers"
    if problem is None and (recorded != files or written["metadata"].get("total_size") != total):
        problem = f"{slim.INDEX} records other shards or sizes than the consolidator reported"
    if problem:
        raise ConsolidationFailed(problem)
    return Consolidated(
        out_dir, tuple(files), index["bytes"], index["sha256"], int(result["tensors"]), seconds,
        str(result["tool"]), identities,
    )  # fmt: skip


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensors: name -> {"dtype", "shape", "data_offsets"}."""
    return read_header(path)


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


def _zero_to_fp32(torch):
    """DeepSpeed's zero_to_fp32, loading safely and memory-mapped, with ZeRO-2's merge made lazy."""
    allowed = dsmeta.optimizer_safe_globals()
    unsafe_load = torch.load

    def safe_load(f, map_location=None, *args, weights_only=None, mmap=None, **kwargs):
        # zero_to_fp32 asks for weights_only=False; it gets the safe loader, three classes, and a
        # mapping: the model states hold the whole 16-bit module, the shards two moments a weight.
        with torch.serialization.safe_globals(allowed):
            try:
                return unsafe_load(f, map_location, *args, weights_only=True, mmap=True, **kwargs)
            except RuntimeError as exc:  # torch's legacy (pre-zip) format cannot be mapped
                if "mmap" not in str(exc):
                    raise
                return unsafe_load(f, map_location, *args, weights_only=True, **kwargs)

    torch.load = safe_load
    from deepspeed.utils import zero_to_fp32

    # ZeRO-2 (trainable) and ZeRO-3 (frozen) parameters are sliced out of a torch.cat of every
    # rank's partition: the same functions, run with a torch whose cat does not materialise.
    lazy = _LazyTorch(torch)
    for name in ("_zero2_merge_trainable_params", "_zero3_merge_frozen_params"):
        fn = getattr(zero_to_fp32, name)
        scope = {**fn.__globals__, "torch": lazy}
        setattr(zero_to_fp32, name, types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__))
    return zero_to_fp32


class _LazyTorch:
    """torch, but `cat` of 1-D tensors along dim 0 returns a `_LazyCat`."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name: str):
        return getattr(self._torch, name)

    def cat(self, tensors, dim=0):
        parts = list(tensors)
        if dim != 0 or not parts or any(t.dim() != 1 for t in parts):
            return self._torch.cat(parts, dim)
        return _LazyCat(self._torch, parts)


class _LazyCat:
    """The concatenation of 1-D tensors, never materialised: what `narrow(0, ...).view(shape)` of it
    would give is gathered from the parts when asked for (`_LazySlice.contiguous`)."""

    def __init__(self, torch, parts):
        self.torch, self.parts, self.dtype = torch, parts, parts[0].dtype
        if any(p.dtype != self.dtype for p in parts):
            raise ValueError("parts of different dtypes")
        self._numel = sum(p.numel() for p in parts)

    def numel(self) -> int:
        return self._numel

    def narrow(self, dim: int, start: int, length: int) -> _LazySlice:
        if dim != 0 or start < 0 or length < 0 or start + length > self._numel:
            raise ValueError(f"narrow({dim}, {start}, {length}) of {self._numel} elements")
        return _LazySlice(self, start, length, self.torch.Size([length]))


class _LazySlice:
    def __init__(self, cat: _LazyCat, start: int, length: int, shape):
        self.cat, self.start, self.length, self.shape = cat, start, length, shape

    @property
    def dtype(self):
        return self.cat.dtype

    def numel(self) -> int:
        return self.length

    def view(self, *shape) -> _LazySlice:
        size = self.cat.torch.Size(shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)
        if size.numel() != self.length:
            raise ValueError(f"view {list(size)} of {self.length} elements")
        return _LazySlice(self.cat, self.start, self.length, size)

    def chunks(self) -> list:
        """The pieces of the partitions this slice covers, in order: views, no copy."""
        out, pos, end = [], 0, self.start + self.length
        for part in self.cat.parts:
            n = part.numel()
            lo, hi = max(self.start, pos), min(end, pos + n)
            if lo < hi:
                out.append(part[lo - pos : hi - pos])
            pos += n
        return out

    def contiguous(self):
        chunks = self.chunks()
        torch = self.cat.torch
        flat = (
            torch.cat(chunks)
            if len(chunks) > 1
            else chunks[0]
            if chunks
            else torch.empty(0, dtype=self.dtype)
        )
        if flat.numel() != self.length:
            raise ValueError(f"gathered {flat.numel()} elements of {self.length}")
        return flat.view(self.shape)


def _chunks(t) -> list:
    """A lazy or real tensor as 1-D pieces whose concatenation is its data, without concatenating:
    a parameter split across ranks costs no copy of itself (and no memory beyond its mapped pages).

    `_LazySlice` (ZeRO-2): pieces of the ranks' partitions. zero_to_fp32's `GatheredTensor`
    (ZeRO-3): the pieces its `contiguous()` concatenates, found as it finds them (the groups of
    each rank that overlap the parameter's partition, rank by rank), cut to the parameter's size.
    Anything else: the tensor itself, flattened.
    """
    if isinstance(t, _LazySlice):
        return t.chunks()
    if type(t).__name__ == "GatheredTensor" and hasattr(t, "flat_groups_offset"):
        end, offsets, out = t.offset + t.partitioned_numel, t.flat_groups_offset, []
        for rank_groups in t.flat_groups:
            for group, flat in enumerate(rank_groups):
                lo, hi = max(t.offset, offsets[group]), min(end, offsets[group + 1])
                if lo < hi:
                    out.append(flat[lo - offsets[group] : hi - offsets[group]])
        left, cut = t.shape.numel(), []  # the last rank's piece is padded
        for c in out:
            if left <= 0:
                break
            cut.append(c[:left])
            left -= cut[-1].numel()
        return cut
    return [t.contiguous().reshape(-1)]


_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip


def _bits(torch, t):
    """A contiguous CPU tensor as its bytes (a uint8 view, no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _same_bytes(torch, flat, pieces: list) -> bool:
    """Whether `flat` (bytes) is, byte for byte, the concatenation of `pieces`. Bitwise: NaN weights
    are weights too."""
    pos = 0
    for piece in pieces:
        b = _bits(torch, piece.contiguous())
        if not torch.equal(flat[pos : pos + b.numel()], b):
            return False
        pos += b.numel()
    return pos == flat.numel()


def _raw(torch, t) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(_bits(torch, t).numpy())


class _Remapped:
    """The lazy state dict, built again after every `REMAP_BYTES` of tensors taken from it.

    The pages of the memory-mapped shards that a tensor was gathered from stay resident (and
    count in RSS) until their mapping goes, and the mappings go with the state dict that holds
    them: so the state dict is dropped and rebuilt (about 0.1 s) now and then.
    """

    def __init__(self, build, every: int = REMAP_BYTES):
        self.build, self.every = build, every
        self.sd: dict | None = None
        self.taken = 0

    def take(self, name: str, size: int):
        if self.sd is None or (self.taken and self.taken + size > self.every):
            self.drop()
            self.sd = self.build()
        self.taken += size
        return self.sd[name]

    def drop(self) -> None:
        # The mappings go by reference counting, with the last tensor that holds them (measured:
        # the same peak RSS as with a gc.collect() here, which took 0.3 s a time).
        self.sd, self.taken = None, 0


def _write_shard(
    torch, path: Path, names: list[str], specs: dict, source: _Remapped, metadata: dict[str, str]
) -> None:
    """Stream `names` into a new safetensors file, one tensor materialised at a time.

    The header comes first, from the shapes and dtypes alone (`specs`: name -> (dtype, shape,
    bytes)), which the lazy tensors know without their data.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        dtype, shape, size = specs[name]
        st = _ST_DTYPES[str(dtype).removeprefix("torch.")]
        header[name] = {"dtype": st, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in names:
            dtype, shape, size = specs[name]
            written = 0
            for piece in _chunks(source.take(name, size)):
                if piece.dtype != dtype:
                    raise ValueError(f"{name} materialised as {piece.dtype}, not {dtype}")
                data = _raw(torch, piece.contiguous())
                f.write(data)
                written += len(data)
                del piece, data
            if written != size:
                raise ValueError(f"{name}: {written} bytes, not {size}")
        f.flush()
        os.fsync(f.fileno())


def _verify_shard(torch, safe_open, path: Path, names: list[str], specs: dict, source: _Remapped) -> str:
    """Read a shard back through safetensors and compare every tensor, byte for byte, with the
    same tensor gathered again from the DeepSpeed shards; return the file's sha256."""
    header = read_header(path)
    if set(header) != set(names):
        raise ValueError(f"{path.name}: read back {len(header)} tensors, wrote {len(names)}")
    f, mapped = None, 0
    try:
        for name in names:
            dtype, shape, size = specs[name]
            if f is None or mapped + size > REOPEN_BYTES:  # a fresh mapping: the old one's pages go
                if f is not None:
                    f.__exit__(None, None, None)
                f = safe_open(str(path), framework="pt").__enter__()
                mapped = 0
            got = f.get_tensor(name)
            mapped += size
            if got.dtype != dtype or list(got.shape) != shape:
                raise ValueError(f"{name} reads back as {list(got.shape)} {got.dtype}")
            if not _same_bytes(torch, _bits(torch, got.contiguous()), _chunks(source.take(name, size))):
                raise ValueError(f"{name} reads back different from what was written")
            del got
    finally:
        if f is not None:
            f.__exit__(None, None, None)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _split(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names in order, in shards of at most `max_bytes` (a larger tensor alone), as transformers splits."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _run(
    save_dir: str,
    tag: str,
    model_states: Path,
    out_dir: Path,
    fingerprint: str,
    max_bytes: int,
    remap_bytes: int,
) -> dict:
    import deepspeed
    import torch
    from safetensors import safe_open

    expected = dsmeta.expected_tensors(model_states)
    zero_to_fp32 = _zero_to_fp32(torch)
    mode = os.stat(model_states).st_mode  # the output is readable like the checkpoint it came from

    def state_dict() -> dict:
        with contextlib.redirect_stdout(sys.stderr):  # it prints progress; stdout carries our result
            return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag, lazy_mode=True)

    sd = state_dict()
    problem = compare(expected, {k: tuple(v.shape) for k, v in sd.items()})
    if problem:
        raise ValueError(problem)
    specs = {k: (v.dtype, list(v.shape), int(v.shape.numel()) * v.dtype.itemsize) for k, v in sd.items()}
    sizes = [(k, size) for k, (_, _, size) in specs.items()]
    del sd
    plan = _split(sizes, max_bytes)
    source = _Remapped(state_dict, remap_bytes)
    tool = f"deepspeed.utils.zero_to_fp32 (deepspeed {deepspeed.__version__})"
    files = []
    for i, names in enumerate(plan, start=1):
        name = slim.shard_name(i, len(plan))
        meta = {"format": "pt", "ckptd": f"zero_to_fp32 of {tag}, shard {i} of {len(plan)}"}
        _write_shard(torch, out_dir / name, names, specs, source, meta)
        source.drop()  # the pages of its mappings go before the read-back maps the shard
        os.chmod(out_dir / name, stat.S_IMODE(mode))
        if i == 1:
            _pause_for_tests()
        sha = _verify_shard(torch, safe_open, out_dir / name, names, specs, source)
        source.drop()
        files.append({"path": name, "bytes": os.stat(out_dir / name).st_size, "sha256": sha})
    record = {"source": tag, "source_fingerprint": fingerprint, "tool": tool, "files": files}
    index = {
        "metadata": {"total_size": sum(size for _, size in sizes), slim.INDEX_RECORD: record},
        "weight_map": {t: slim.shard_name(i, len(plan)) for i, names in enumerate(plan, 1) for t in names},
    }
    data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    fd = os.open(
        out_dir / slim.INDEX, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(out_dir / slim.INDEX, stat.S_IMODE(mode))
    dir_fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return {
        "files": files,
        "index": {"path": slim.INDEX, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
        "tensors": len(sizes),
        "tool": tool,
    }


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
    p = argparse.ArgumentParser(prog="python -m ckptd.removal.zero_to_fp32", description=__doc__.splitlines()[0])
    p.add_argument("save_dir", help="the directory holding global_step<N>/")
    p.add_argument("tag", help="global_step<N>")
    p.add_argument("model_states", type=Path, help="its model-states file, for param_shapes")
    p.add_argument("out_dir", type=Path, help="an empty directory for the shards and the index")
    p.add_argument("--source-fingerprint", default="", help="recorded in the index (slim.source_fingerprint)")
    p.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES, help="the largest shard")
    p.add_argument("--remap-bytes", type=int, default=REMAP_BYTES, help="drop the mappings after this much")
    args = p.parse_args(argv)
    _die_with_parent()
    with contextlib.suppress(OSError):
        os.nice(19)
    try:
        result = _run(
            args.save_dir,
            args.tag,
            args.model_states,
            args.out_dir,
            args.source_fingerprint,
            args.max_shard_bytes,
            args.remap_bytes,
        )
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
