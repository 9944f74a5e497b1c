"""Reading a DeepSpeed checkpoint's metadata, safely.

A model-states file is a torch.save zip whose `data.pkl` holds plain data
(ints, strings, dicts) around tensors. The world sizes and the ZeRO stage
are read by `read_plain_data`: Python's own unpickler with every global
replaced by an inert placeholder and every tensor storage left unread. No
class or function named in the file is ever looked up, so nothing in it can
run, and torch is not needed: a daemon that imported torch for this would
cost ~1.4 s and ~220 MiB more on every training node.

A file that is not a zip (torch's legacy format, or not a torch file at
all) goes to torch, lazily imported, with `weights_only=True` and nothing
looser. Optimizer shards (read only when slimming) pickle three DeepSpeed
classes that torch's safe loader refuses (measured on 0.19.8: `LossScaler`,
`ZeroStageEnum`, `fragment_address`); `optimizer_safe_globals` allow-lists
exactly those, and nothing else, for `torch.serialization.safe_globals`.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import pickletools
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ckptd.volume import volread


class MetadataUnavailable(Exception):
    """The world sizes cannot be read: no torch, or an unreadable file."""


@dataclass(frozen=True)
class WorldSizes:
    dp: int
    mp: int
    stage: int | None  # ZeRO stage from the saved ds_config, if recorded
    source: str  # where the numbers came from, for the evidence detail
    # Whether each rank writes an optimizer shard, from the model states' own structure rather
    # than the ds_config (which may be a path, or say stage 0 while BF16_Optimizer shards):
    # `param_shapes` is saved exactly when a ZeRO optimizer is, and BF16_Optimizer's state
    # (saved in the model states too) carries its partitions.
    shards: bool = False
    bf16: bool | None = None  # from ds_config's bf16.enabled, if recorded: the shards' name prefix


_torch_lock = threading.Lock()


@functools.cache
def _torch():
    with _torch_lock:
        try:
            import torch
        except ImportError as exc:
            raise MetadataUnavailable(f"torch is not installed ({exc})") from None
        return torch


def load_safely(path: Path) -> dict:
    """`torch.load(path, weights_only=True, mmap=True)` on the CPU, and nothing looser."""
    torch = _torch()
    try:
        # torch opens it by name (mmap needs one): a FIFO or device is refused first (volread).
        os.close(volread.open_regular(path))
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many kinds: UnpicklingError, RuntimeError, OSError...
        text = str(exc).strip()
        first_line = text.splitlines()[0][:160] if text else type(exc).__name__
        raise MetadataUnavailable(f"cannot load {path.name} with weights_only=True: {first_line}") from exc
    if not isinstance(obj, dict):
        raise MetadataUnavailable(f"{path.name} does not hold a dict")
    return obj


class _Inert:
    """Stands in for every object a pickle would construct: accepts anything, does nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def append(self, value: object) -> None:
        pass

    def extend(self, values: object) -> None:
        pass


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        return _Inert  # never the named class or function

    def persistent_load(self, pid: object) -> object:
        return _Inert()  # tensor storages: not read


MAX_PICKLE_BYTES = 64 * 1024 * 1024
MAX_WORLD = 65536  # more ranks than any job has run; a larger number is a hostile or broken file


def _check_pickle(data: bytes, name: str) -> None:
    """Refuse pickles that would make the unpickler allocate far beyond their size.

    CPython's unpickler grows its memo to the largest index a PUT names and
    preallocates the length a BINBYTES8 declares: nine bytes can ask for
    gigabytes. pickletools only reads what is there, so it is safe to walk.
    """
    puts = 0
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            if not isinstance(arg, int) or arg > puts + 1024:
                raise MetadataUnavailable(f"{name}: memo index {arg} out of proportion")
            puts += 1
        elif op.name == "MEMOIZE":
            puts += 1
        elif op.name in ("EXT1", "EXT2", "EXT4"):
            raise MetadataUnavailable(f"{name}: pickle extension codes are not accepted")


def read_plain_data(path: Path) -> dict:
    """The plain-data skeleton of a torch.save file, without torch and without running anything."""
    try:
        with volread.open_file(path) as f, zipfile.ZipFile(f) as z:
            name = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                raise MetadataUnavailable(f"{path.name} has no data.pkl")
            if z.getinfo(name).file_size > MAX_PICKLE_BYTES:
                raise MetadataUnavailable(f"{path.name}: data.pkl larger than {MAX_PICKLE_BYTES} bytes")
            data = z.read(name)
        _check_pickle(data, path.name)
        obj = _PlainUnpickler(io.BytesIO(data)).load()
    except MetadataUnavailable:
        raise
    except Exception as exc:  # zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ...
        raise MetadataUnavailable(f"cannot read {path.name}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise MetadataUnavailable(f"{path.name} does not hold a dict")
    return obj


def _head(path: Path) -> bytes:
    try:
        return volread.read_bytes(path, 4)
    except OSError:
        return b""


def read_world_sizes(path: Path) -> WorldSizes:
    """dp/mp world sizes and ZeRO stage from a model-states file."""
    try:
        with volread.open_file(path) as f:  # never a FIFO (zipfile would block opening it)
            is_zip = zipfile.is_zipfile(f)
    except OSError as exc:
        raise MetadataUnavailable(f"cannot read {path.name}: {exc.strerror or exc}") from None
    if is_zip:
        sd = read_plain_data(path)
    else:
        head = _head(path)
        if head.startswith(b"PK\x03\x04") or not head:
            # A zip still being written (its directory comes last), or a file just created:
            # nothing to read yet, and no reason to import torch (~220 MiB) for it.
            raise MetadataUnavailable(f"{path.name} is an incomplete zip (still being written?)")
        if not head.startswith(b"\x80"):  # torch's legacy format is a pickle: it starts with PROTO
            raise MetadataUnavailable(f"{path.name} is neither a zip nor a pickle")
        sd = load_safely(path)  # the legacy (pre-1.6) format: torch decides, weights_only
    dp, mp = sd.get("dp_world_size"), sd.get("mp_world_size")
    usable = isinstance(dp, int) and isinstance(mp, int) and not isinstance(dp, bool)
    if not usable or not (1 <= dp <= MAX_WORLD and 1 <= mp <= MAX_WORLD):
        raise MetadataUnavailable(f"{path.name} has no usable dp_world_size/mp_world_size ({dp!r}, {mp!r})")
    stage, bf16 = None, None
    ds_config = sd.get("ds_config")
    if isinstance(ds_config, dict):
        zero = ds_config.get("zero_optimization")
        if isinstance(zero, dict) and isinstance(zero.get("stage"), int):
            stage = zero["stage"]
        half = ds_config.get("bf16")
        if isinstance(half, dict) and isinstance(half.get("enabled"), bool):
            bf16 = half["enabled"]
    optimizer = sd.get("optimizer")
    partitioned = isinstance(optimizer, dict) and bool(_BF16_OPTIMIZER_KEYS & set(optimizer))
    shards = sd.get("param_shapes") is not None or partitioned
    bf16 = True if partitioned else bf16
    return WorldSizes(dp=dp, mp=mp, stage=stage, source=path.name, shards=shards, bf16=bf16)


# BF16_Optimizer.state_dict() (deepspeed/runtime/bf16_optimizer.py): its fp32 partitions are per rank.
_BF16_OPTIMIZER_KEYS = frozenset({"single_partition_of_fp32_groups", "partition_count"})


def optimizer_safe_globals() -> list:
    """The DeepSpeed classes an optimizer shard pickles, for `torch.serialization.safe_globals`.

    Imports deepspeed: only the consolidation subprocess calls this.
    """
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def expected_tensors(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors zero_to_fp32 reconstructs from a checkpoint, by name, with their shapes.

    From a model-states file: `param_shapes` (every parameter group),
    `frozen_param_shapes`, the buffers in `module`, and the aliases in
    `shared_params` (tied weights), each with its owner's shape.
    """
    sd = load_safely(path)
    groups = sd.get("param_shapes")
    if isinstance(groups, dict):
        groups = [groups]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise MetadataUnavailable(f"{path.name} has no usable param_shapes")
    out: dict[str, tuple[int, ...]] = {}
    for group in groups:
        out.update((str(k), tuple(int(n) for n in v)) for k, v in group.items())
    frozen = sd.get("frozen_param_shapes")
    if isinstance(frozen, dict):
        out.update((str(k), tuple(int(n) for n in v)) for k, v in frozen.items())
    module = sd.get("module") if isinstance(sd.get("module"), dict) else {}
    for name in sd.get("buffer_names") or ():
        if name in module:
            out[name] = tuple(module[name].shape)
    shared = sd.get("shared_params")
    for alias, owner in shared.items() if isinstance(shared, dict) else ():
        if owner in out:
            out[alias] = out[owner]
    return out
