"""Generated volumes kept across test runs: the frameworks' and DeepSpeed's own saves take minutes
to write on 2 cores, and a second run with the same generator and the same packages would write
the same thing.

An entry is keyed by what could change what is written: the generator's name and arguments, the
source of the generator modules (tests/support/fwgen.py, dsgen.py, ...), the Python version and the
installed versions of the frameworks. A run that finds its key copies the entry into its own
session directory (a private copy: nothing a test does reaches the cache) and shifts every mtime
by the time since the entry was written, so the copy is as old, file by file, as a volume
generated just now would be (quiet periods and "written last" see what they would have seen).
The generator's result (paths in it) is rebased onto the copy.

Where: $CKPTD_TESTS_CACHE, else $XDG_CACHE_HOME/ckptd-tests, else ~/.cache/ckptd-tests.
CKPTD_TESTS_NO_CACHE=1 generates afresh and stores nothing. Delete the folder to drop it all.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The distributions whose version can change what a generator writes.
PACKAGES = ("torch", "deepspeed", "jax", "jaxlib", "orbax-checkpoint", "accelerate", "lightning",
            "transformers", "safetensors", "keras", "numpy", "h5py", "mosaicml", "ray")


def cache_dir() -> Path | None:
    """Where generated volumes are kept; None with CKPTD_TESTS_NO_CACHE."""
    if os.environ.get("CKPTD_TESTS_NO_CACHE"):
        return None
    return cache_root()


def cache_root() -> Path:
    """The tests' cache folder (also where tests/support/composerenv.py keeps Composer's install)."""
    if where := os.environ.get("CKPTD_TESTS_CACHE"):
        return Path(where)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ckptd-tests"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def key(name: str, args: Any, sources: Iterable[str]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"name": name, "args": args, "python": sys.version,
                         "packages": {d: _version(d) for d in PACKAGES}}, sort_keys=True, default=str).encode())
    for source in sorted(sources):
        h.update(source.encode() + b"\0" + (HERE / source).read_bytes())
    return h.hexdigest()[:20]


def _encode(value: Any) -> Any:
    if isinstance(value, Path):
        return {"__path__": str(value)}
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any, old: str, new: str) -> Any:
    """Paths (and strings naming one) under `old` are rebased onto `new`."""
    if isinstance(value, dict) and set(value) == {"__path__"}:
        return Path(_decode(value["__path__"], old, new))
    if isinstance(value, str):
        return new + value[len(old):] if value == old or value.startswith(old + os.sep) else value
    if isinstance(value, dict):
        return {k: _decode(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, old, new) for v in value]
    return value


def _shift_mtimes(top: Path, delta: float) -> None:
    paths = [top]
    for dirpath, dirnames, filenames in os.walk(top):
        paths += [Path(dirpath) / n for n in (*dirnames, *filenames)]
    # children before their directory: setting a file's times does not change its directory's
    for path in sorted(paths, key=lambda p: len(p.parts), reverse=True):
        st = path.lstat()
        ns = int(delta * 1e9)
        os.utime(path, ns=(st.st_atime_ns + ns, st.st_mtime_ns + ns), follow_symlinks=False)


def generated(name: str, args: Any, sources: Iterable[str], out: Path, make: Callable[[Path], Any]) -> Any:
    """make(out)'s result, with out written by it, or a copy of what an earlier run's make wrote
    (same key). The result is JSON and Paths; those under `out` (and strings naming one) are rebased."""
    out = Path(out).resolve()
    root = cache_dir()
    if root is None:
        return make(out)
    entry = root / f"{name}-{key(name, args, sources)}"
    root.mkdir(parents=True, exist_ok=True)
    # One generator per key at a time across processes (pytest-xdist's workers each run the session
    # fixtures): the second waits for the first and copies what it stored instead of writing it again.
    with open(root / f".{entry.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _generated(entry, out, make)


def _generated(entry: Path, out: Path, make: Callable[[Path], Any]) -> Any:
    root = entry.parent
    meta_file = entry / "meta.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        shutil.copytree(entry / "out", out, symlinks=True, dirs_exist_ok=True)
        _shift_mtimes(out, time.time() - meta["finished"])
        return _decode(meta["result"], meta["out"], str(out))
    result = make(out)
    finished = time.time()
    tmp = root / f".{entry.name}.{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        shutil.copytree(out, tmp / "out", symlinks=True)
        meta = {"out": str(out), "finished": finished, "result": _encode(result)}
        (tmp / "meta.json").write_text(json.dumps(meta))
        os.rename(tmp, entry)  # another session may have stored the same key meanwhile: keep theirs
    except (OSError, TypeError, ValueError):
        pass  # a cache that cannot be written is no cache: the run goes on with what it generated
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result
