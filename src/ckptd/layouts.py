"""Recognising checkpoints by name and shape.

Pure: each function gets names (an entry, its siblings, its children) and
answers whether it is a checkpoint, of which layout, at which step. Anything
not recognised here is never touched.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

HF = "hf"  # Hugging Face Trainer: checkpoint-<step>/
DEEPSPEED = "deepspeed"  # bare DeepSpeed: global_step<step>/ beside `latest`
MEGATRON = "megatron"  # Megatron-LM: iter_<step:07d>/ + latest_checkpointed_iteration.txt
DCP = "dcp"  # torch.distributed.checkpoint: a directory of *.distcp + .metadata
ORBAX = "orbax"  # Orbax: <step>/, in progress as <step>.orbax-checkpoint-tmp-*
NEMO = "nemo"  # NeMo / Lightning: ...step=<step>... (.ckpt/.nemo file or directory)
ACCELERATE = "accelerate"  # accelerate's save_state(): checkpoint_<n>/, step_<n>/, epoch_<n>/
PATTERN = "pattern"  # a user pattern such as ckpt_{step}

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
NEMO_UNFINISHED_SUFFIX = "-unfinished"
ORBAX_TMP = ".orbax-checkpoint-tmp"
PIN_FILE = ".ckptd-keep"
TRASH_DIR = ".ckptd-trash"
LEASE_DIR = ".ckptd"  # the volume lease (lease.py)

_HF = re.compile(r"checkpoint-(\d+)")
_DEEPSPEED = re.compile(r"global_step(\d+)")
_MEGATRON = re.compile(r"iter_(\d{7,})")
_ORBAX = re.compile(r"(\d+)")
_ORBAX_TMP = re.compile(r"(\d+)\.orbax-checkpoint-tmp.*")
# NeMo and Lightning name checkpoints `...--step=N-...` or `epoch=E-step=N`; not `warmup_step=N`
# (a Hydra sweep directory such as `lr=0.1,warmup_step=100` is a run, not a checkpoint).
_NEMO_STEP = re.compile(r"(?:^|-)step=(\d+)")
# What a NeMo distributed-checkpoint directory holds (NeMo 1: torch_dist; NeMo 2: weights/ + context/).
_NEMO_DIR_MARKERS = frozenset({"weights", "context", "metadata.json", "common.pt", ".metadata"})
_LAST_INT = re.compile(r"(\d+)(?!.*\d)")

# Files Orbax writes into a finalized step directory.
ORBAX_METADATA = "_CHECKPOINT_METADATA"
ORBAX_COMMIT = "commit_success.txt"
_ORBAX_MARKERS = frozenset({ORBAX_METADATA, ORBAX_COMMIT})

# accelerate's Accelerator.save_state(): `checkpoint_<n>` with automatic_checkpoint_naming (a
# save counter), `step_<n>`/`epoch_<n>` as its examples name them; recognised by the files
# only it writes (accelerate/checkpointing.py save_accelerator_state: models, then
# optimizer.bin, scheduler.bin, sampler.bin, scaler.pt, and random_states_<process>.pkl last).
_ACCELERATE = re.compile(r"(?:checkpoint|step|epoch)_(\d+)")
_ACCELERATE_MARKER = re.compile(
    r"(?:optimizer|scheduler|sampler|dl_state_dict)(?:_\d+)?\.bin|random_states_\d+\.pkl|scaler\.pt"
)


@dataclass(frozen=True)
class Candidate:
    name: str
    step: int
    layout: str
    is_dir: bool
    in_progress: bool = False  # the layout's own "not finished" name (Orbax tmp)
    pattern: int | None = None  # which of the root's patterns matched (PATTERN layout)


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """`ckpt_{step}` -> a regex matching the whole name, the step captured."""
    before, after = pattern.split("{step}")
    return re.compile(re.escape(before) + r"(\d+)" + re.escape(after))


def recognise_by_name(
    name: str, is_dir: bool, patterns: Collection[re.Pattern[str]] = ()
) -> Candidate | None:
    """Layouts that a name alone identifies."""
    if is_dir:
        for regex, layout in ((_HF, HF), (_DEEPSPEED, DEEPSPEED), (_MEGATRON, MEGATRON)):
            if m := regex.fullmatch(name):
                return Candidate(name, int(m[1]), layout, is_dir)
        if m := _ORBAX_TMP.fullmatch(name):
            return Candidate(name, int(m[1]), ORBAX, is_dir, in_progress=True)
    for i, regex in enumerate(patterns):
        if m := regex.fullmatch(name):
            return Candidate(name, int(m[1]), PATTERN, is_dir, pattern=i)
    nemo_like = is_dir or name.endswith((".ckpt", ".nemo"))
    if nemo_like and not name.endswith(NEMO_UNFINISHED_SUFFIX) and (m := _NEMO_STEP.search(name)):
        return Candidate(name, int(m[1]), NEMO, is_dir)
    return None


def recognise_by_contents(name: str, children: Collection[str]) -> Candidate | None:
    """Layouts that need a look inside: DCP, finalized Orbax and accelerate directories.

    A numeric directory is an Orbax step only with Orbax's own files in it, so
    a run or team directory that happens to be called `42` is never mistaken
    for a checkpoint; `step_3` is accelerate's only with accelerate's own files.
    """
    if (m := _ORBAX.fullmatch(name)) and _ORBAX_MARKERS & set(children):
        return Candidate(name, int(m[1]), ORBAX, True)
    if (m := _ACCELERATE.fullmatch(name)) and any(_ACCELERATE_MARKER.fullmatch(c) for c in children):
        return Candidate(name, int(m[1]), ACCELERATE, True)
    is_dcp = ".metadata" in children or any(c.endswith(".distcp") for c in children)
    if is_dcp and (m := _LAST_INT.search(name)):
        return Candidate(name, int(m[1]), DCP, True)
    return None


def nemo_unfinished_marker(name: str) -> str:
    """NeMo's marker for `name`: the name without .ckpt/.nemo, plus `-unfinished`."""
    return name.removesuffix(".nemo").removesuffix(".ckpt") + NEMO_UNFINISHED_SUFFIX


def recognise(
    name: str,
    is_dir: bool,
    children: Callable[[], Collection[str]],
    patterns: Collection[re.Pattern[str]] = (),
) -> Candidate | None:
    """Whether `name` (an entry of a candidate run directory) is a checkpoint.

    A directory recognised by a loose rule (a NeMo-style name, a user pattern,
    DCP or Orbax contents) is not a checkpoint if it holds checkpoints itself:
    then it is a run, and deleting it "as a checkpoint" would delete the run.
    """
    cand = recognise_by_name(name, is_dir, patterns)
    if not is_dir:
        return cand
    if cand is not None and (cand.layout in (HF, DEEPSPEED, MEGATRON) or cand.in_progress):
        return cand
    inside = children()
    if cand is None:
        cand = recognise_by_contents(name, inside)
    if cand is None:
        return None
    nemo_dir_markers = _NEMO_DIR_MARKERS & set(inside) or any(c.endswith(".distcp") for c in inside)
    if cand.layout == NEMO and not name.endswith((".ckpt", ".nemo")) and not nemo_dir_markers:
        return None
    if any(recognise_by_name(c, True, patterns) for c in inside):
        return None
    return cand
