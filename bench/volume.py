"""Synthetic training volumes, shaped like real ones.

A volume is R runs × C checkpoints, each checkpoint a Hugging Face Trainer
`checkpoint-N/` saved under DeepSpeed ZeRO-2 with W ranks:

    <root>/team-<t>/run-<r>/checkpoint-<N>/
        global_step<N>/mp_rank_00_model_states.pt            torch-loadable, holds dp_world_size=W
        global_step<N>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   one per rank: the shards
        rng_state_<r>.pth                                    one per rank
        trainer_state.json, model.safetensors, config.json, ... ~11 small files

Files hold no weights: a shard is zeros followed by a small zip directory,
which is all ckptd's integrity check reads. The model-states file is a real
torch zip (written without torch), so a ckptd with torch installed reads
the world size from it, as it would on a real volume. Mtimes are set with
`os.utime`, oldest checkpoint first, never by sleeping.
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

HOUR = 3600.0


@dataclass(frozen=True)
class Shape:
    """How big a volume is: runs × checkpoints per run × ranks (shards per checkpoint)."""

    name: str
    runs: int
    checkpoints: int
    world: int

    @property
    def files_per_checkpoint(self) -> int:
        return 2 * self.world + len(SMALL_FILES) + 1  # shards + rng states + small + model states

    @property
    def entries(self) -> int:
        """Files and directories under the root (what `find` prints)."""
        teams = min(self.runs, TEAMS)
        per_ckpt = self.files_per_checkpoint + 2  # checkpoint-N/ and global_stepN/
        return 1 + teams + self.runs + self.runs * self.checkpoints * per_ckpt

    def describe(self) -> str:
        return (
            f"{self.name}: {self.runs} runs × {self.checkpoints} checkpoints × {self.world} ranks "
            f"= {self.runs * self.checkpoints} checkpoints, {self.entries:,} entries"
        )


TEAMS = 4
SIZES = {
    "T": Shape("T", runs=2, checkpoints=4, world=4),  # --quick only
    "S": Shape("S", runs=4, checkpoints=10, world=16),  # ≈ 2k entries
    "M": Shape("M", runs=16, checkpoints=60, world=32),  # ≈ 75k entries
    "L": Shape("L", runs=64, checkpoints=100, world=32),  # ≈ 500k entries
    # 1,003,200 files (`--only watchscale` only): about a minute to build, 4 GiB of 4 KiB blocks
    "XL": Shape("XL", runs=132, checkpoints=100, world=32),
}
STEP = 500  # steps between saves


def _zip(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return out.getvalue()


def model_states(world: int, stage: int = 2) -> bytes:
    """A file `torch.load(weights_only=True, mmap=True)` reads as DeepSpeed's model states.

    torch's zip format: `archive/data.pkl` (protocol-2 pickle), `byteorder`, `version`.
    """
    sd = {"dp_world_size": world, "mp_world_size": 1, "ds_config": {"zero_optimization": {"stage": stage}}}
    return _zip(
        {
            "archive/data.pkl": pickle.dumps(sd, protocol=2),
            "archive/byteorder": b"little",
            "archive/version": b"3\n",
        }
    )


ZIP_TAIL = _zip({"archive/data.pkl": b"\x80\x02}q\x00."})  # an empty dict, pickled


class _At(io.BytesIO):
    """A buffer that says it starts `at` bytes into a file: zipfile then records offsets that hold
    with `at` bytes of zeros before it, as a real archive's do (ckptd checks them)."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def tell(self) -> int:
        return self.at + super().tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.at + super().seek(pos - self.at if whence == 0 else pos, whence)


@functools.cache
def _zip_after(pad: int) -> bytes:
    out = _At(pad)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")  # an empty dict, pickled
    return out.getvalue()


# A zip begins with a member's local header, and ckptd checks that it does (wholefile.py): the padding
# of a stand-in starts with the header's signature, where a real archive's first member would start.
_LOCAL = b"PK\x03\x04"


def _padding(n: int) -> bytes:
    return (_LOCAL + b"\0" * (n - len(_LOCAL)))[:n] if n else b""


def shard_bytes(size: int) -> bytes:
    """A torch-file stand-in of about `size` bytes: a local header's signature and zeros, then a zip
    directory whose offsets count them (what ckptd reads of a torch file: its two ends)."""
    pad = max(0, size - len(ZIP_TAIL))
    return _padding(pad) + _zip_after(pad)


def write_shard(path: Path, size: int, *, chunk: int = 16 << 20) -> None:
    """`shard_bytes(size)` written in chunks, for shards too big to build in memory."""
    pad = max(0, size - len(ZIP_TAIL))
    tail = _zip_after(pad)
    zeros = b"\0" * min(chunk, pad)
    with open(path, "wb") as f:
        if pad:
            f.write(_padding(min(pad, len(_LOCAL))))
            pad -= min(pad, len(_LOCAL))
        while pad > 0:
            n = min(pad, len(zeros))
            f.write(zeros[:n] if n < len(zeros) else zeros)
            pad -= n
        f.write(tail)


def _safetensors() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * 16


SMALL_FILES: dict[str, bytes] = {
    "latest": b"",  # filled per checkpoint
    "zero_to_fp32.py": b"# DeepSpeed's conversion script\n" * 20,
    "config.json": json.dumps({"model_type": "llama", "hidden_size": 4096}).encode(),
    "generation_config.json": b'{"do_sample": false}',
    "model.safetensors": _safetensors(),
    "trainer_state.json": b"",  # filled per checkpoint
    "training_args.bin": ZIP_TAIL,
    "scheduler.pt": ZIP_TAIL,
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b'{"model_max_length": 4096}',
    "special_tokens_map.json": b'{"eos_token": "</s>"}',
}


def eval_loss(run: int, step: int) -> float:
    """A loss curve that falls and then wobbles, so 'best' is not always the newest."""
    i = step // STEP
    return round(2.0 / (1 + 0.1 * i) + 0.05 * ((i * 7 + run) % 5), 4)


def trainer_state(run: int, step: int) -> bytes:
    history: list[dict[str, object]] = []
    for s in range(STEP, step + 1, STEP):
        history.append({"step": s, "loss": eval_loss(run, s) + 0.1, "learning_rate": 1e-4, "epoch": s / 1e4})
        history.append({"step": s, "eval_loss": eval_loss(run, s), "epoch": s / 1e4})
    evals = range(STEP, step + 1, STEP)
    best = min(evals, key=lambda s: (eval_loss(run, s), -s)) if evals else None
    return json.dumps(
        {
            "global_step": step,
            "best_metric": eval_loss(run, best) if best else None,
            "best_model_checkpoint": f"/mnt/out/run-{run}/checkpoint-{best}" if best else None,
            "log_history": history,
        }
    ).encode()


def _write(path: str, data: bytes, mtime: float | None) -> None:
    with open(path, "wb") as f:
        f.write(data)
    _age(path, mtime)


def _age(path: str | Path, mtime: float | None) -> None:
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def write_checkpoint(
    run_dir: Path,
    step: int,
    *,
    world: int,
    run: int = 0,
    mtime: float | None,
    shard_size: int = 0,
    skip: frozenset[str] = frozenset(),
    states: bytes | None = None,
) -> Path:
    """One Trainer + DeepSpeed checkpoint, every file and directory with mtime `mtime`.

    `mtime=None`: a live save, as a trainer writes one (each file written and closed, no `utime`
    afterwards, which inotify would report only as an attribute change).
    """
    ckpt = run_dir / f"checkpoint-{step}"
    gs = ckpt / f"global_step{step}"
    gs.mkdir(parents=True)
    shard = shard_bytes(shard_size) if shard_size < (64 << 20) else None
    names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    _write(str(gs / "mp_rank_00_model_states.pt"), states or model_states(world), mtime)
    for name in names:
        if name in skip:
            continue
        if shard is None:
            write_shard(gs / name, shard_size)
            _age(gs / name, mtime)
        else:
            _write(str(gs / name), shard, mtime)
    for r in range(world):
        _write(str(ckpt / f"rng_state_{r}.pth"), ZIP_TAIL, mtime)
    for name, data in SMALL_FILES.items():
        if name == "latest":
            data = f"global_step{step}".encode()
        elif name == "trainer_state.json":
            data = trainer_state(run, step)
        _write(str(ckpt / name), data, mtime)
    _age(gs, mtime)
    _age(ckpt, mtime)
    return ckpt


@dataclass(frozen=True)
class Volume:
    root: Path
    shape: Shape
    config: Path  # ckptd config for this volume (world_size set: the census needs no torch)
    state_dir: Path

    def run_dirs(self) -> list[Path]:
        return sorted(p for team in self.root.iterdir() for p in team.iterdir())


def build(base: Path, shape: Shape, *, now: float) -> Volume:
    """The volume under `base/<name>/root`, a config beside it. Every checkpoint is complete.

    Checkpoint i of a run was saved (C - i) × 30 min before `now`, the newest an hour ago.
    """
    root = base / shape.name / "root"
    states = model_states(shape.world)
    for r in range(shape.runs):
        run_dir = root / f"team-{r % TEAMS}" / f"run-{r}"
        for i in range(shape.checkpoints):
            mtime = now - HOUR - (shape.checkpoints - 1 - i) * HOUR / 2
            write_checkpoint(run_dir, (i + 1) * STEP, world=shape.world, run=r, mtime=mtime, states=states)
    state_dir = base / shape.name / "state"
    config = base / shape.name / "ckptd.toml"
    write_config(config, root, state_dir, world=shape.world)
    return Volume(root, shape, config, state_dir)


def write_config(
    path: Path, root: Path, state_dir: Path, *, world: int, keep_last: int = 2, keep_best: int = 1
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"[daemon]\nstate_dir = '{state_dir}'\n\n"
        f"[[roots]]\npath = '{root}'\nquiet_period = '60s'\n"
        "# torch may be hidden: the shard census then takes the world size from here\n"
        f"world_size = {world}\n\n"
        f"[roots.retention]\nkeep_last = {keep_last}\nkeep_best = {keep_best}\n"
        "metric = 'eval_loss'\nmode = 'min'\n"
    )
