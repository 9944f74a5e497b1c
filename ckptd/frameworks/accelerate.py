"""accelerate's `Accelerator.save_state()`: `checkpoint_<n>/` (automatic naming), `step_<n>/`, `epoch_<n>/`.

accelerate/checkpointing.py save_accelerator_state, from Accelerator.save_state: the models
(`model.safetensors`, `model_1.safetensors`, ... or `pytorch_model.bin`; FSDP's through
save_fsdp_model; under DeepSpeed each model's tag `pytorch_model[_<i>]/`, DeepSpeed's census), the
optimizers, schedulers, samplers, `scaler.pt`, then each process its `random_states_<i>.pkl`, last.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from ckptd.frameworks import copyin, hfweights
from ckptd.frameworks.base import (
    FAILED,
    PASSED,
    Evidence,
    Framework,
    Remembered,
    Save,
    files_whole,
    known_world,
    rank_files,
    read_now,
)
from ckptd.frameworks.deepspeed import DS_FILE, census, deepspeed_tag_dirs
from ckptd.model import EPOCH, SAVE, STEP, Candidate, Check, Entry
from ckptd.volume import volread

LAYOUT = "accelerate"
# `checkpoint_<n>` with automatic_checkpoint_naming (a save counter), `step_<n>`/`epoch_<n>` as its
# examples name them; recognised by the files only it writes (accelerate/checkpointing.py
# save_accelerator_state: models, then optimizer.bin, scheduler.bin, sampler.bin, scaler.pt, and
# random_states_<process>.pkl last).
_NAME = re.compile(r"(?:checkpoint|step|epoch)_(\d+)")
_MARKER = re.compile(
    r"(?:optimizer|scheduler|sampler|dl_state_dict)(?:_\d+)?\.bin|random_states_\d+\.pkl|scaler\.pt"
)

_ACCELERATE_FILE = re.compile(
    r"(?:optimizer|scheduler|sampler|random_states)(?:_\d+)?\.(?:bin|pkl|pt)|scaler\.pt"
)
_RANDOM_STATES = re.compile(r"random_states_(\d+)\.pkl")  # accelerate's, one per process, written last
_ACCELERATE_BEFORE = re.compile(r"(?:optimizer|scheduler|sampler)(?:_\d+)?\.(?:bin|pt)|scaler\.pt")


def _before_random_states(rel: str) -> bool:
    return bool(_ACCELERATE_BEFORE.fullmatch(rel) or ("/" in rel and DS_FILE.fullmatch(rel)))


# save_accelerator_state (accelerate checkpointing.py) writes one file per prepared object:
# optimizer.bin, optimizer_1.bin, ...; scheduler.bin, ...; sampler.bin, ... (FSDP: the optimizer
# through save_fsdp_optimizer, `optimizer_<i>.bin` or `optimizer_<i>/`); scaler.pt with a scaler.
# The checkpoint cannot say how many were prepared, so: the i-th present means 0..i-1 must be,
# and a kind the run's earlier complete checkpoints all have must be (against_sibling_kinds).
_PER_OBJECT = re.compile(r"(optimizer|scheduler|sampler)(?:_(\d+))?(?:\.bin|\.pt)?|scaler\.pt")
# The same for each prepared model (the first model's weights are the weights check's) and each
# object registered with `register_for_checkpointing` (save_custom_state: `custom_checkpoint_<i>.pkl`,
# numbered from 0): load_state raises FileNotFoundError for a model's weights not there, and
# "Number of custom checkpoints ... does not match" for a registered object's file.
_MODEL_FILE = re.compile(r"(?:model|pytorch_model)(?:_(\d+))?\.(?:safetensors|bin)")
_CUSTOM = re.compile(r"custom_checkpoint_(\d+)\.pkl")


def _numbered(stem: str, suffix: str, first_bare: bool, i: int) -> str:
    """The name of the i-th object's file: `optimizer.bin`, `optimizer_1.bin`; `custom_checkpoint_0.pkl`."""
    return f"{stem}{suffix}" if i == 0 and first_bare else f"{stem}_{i}{suffix}"


def _object_files(files: Mapping[str, Entry]) -> tuple[Check, frozenset[str]]:
    name = "accelerate objects"
    top = [rel for rel in files if "/" not in rel]
    objects = {rel for rel in top if _PER_OBJECT.fullmatch(rel)}
    models = {int(m[1] or 0) for rel in top if (m := _MODEL_FILE.fullmatch(rel))}
    customs = {int(m[1]) for rel in top if (m := _CUSTOM.fullmatch(rel))}
    # what a later save of the run must hold too (against_sibling_kinds); a model's weights by its
    # index whichever format they were saved in
    kinds = frozenset(objects | {f"model_{i} weights" for i in models if i}
                      | {f"custom_checkpoint_{i}.pkl" for i in customs})
    numbered = [  # (the indices present, the file's stem and suffix, whether index 0 has no number)
        *(({int(m[2] or 0) for rel in objects if (m := _PER_OBJECT.fullmatch(rel)) and m[1] == what},
           what, ".bin", True) for what in ("optimizer", "scheduler", "sampler")),
        (models, "model", ".safetensors", True),
        (customs, "custom_checkpoint", ".pkl", False),  # registered objects are numbered from 0
    ]
    for present, stem, suffix, first_bare in numbered:
        n = max(present, default=-1) + 1
        if len(present) < n:  # indices 0..n-1 all there exactly when n distinct ones are
            gap = next(i for i in range(n) if i not in present)  # at most len(present)+1 steps
            have, lack = (_numbered(stem, suffix, first_bare, i) for i in (n - 1, gap))
            why = f"{have} present, {lack} missing (one file per prepared object)"
            return Check(name, FAILED, why), kinds
    return Check(name, PASSED, ", ".join(sorted(kinds)) or "none (no optimizer, scheduler or sampler)"), kinds


# random_states_<i>.pkl and custom_checkpoint_<i>.pkl are torch.save files (checkpointing.py
# save_accelerator_state, save_custom_state): a zip archive, or with the legacy serializer a plain
# pickle. load_state swallows an unreadable RNG file and goes on without it. Checked without
# unpickling: not empty, and ending as its format ends, a zip in its end-of-central-directory
# record (torch writes no comment), a pickle in its STOP opcode.
_PICKLES = re.compile(r"(?:random_states|custom_checkpoint)_\d+\.pkl")


def pickle_problem(path: Path, size: int) -> str | None:
    if size == 0:
        return "is empty"
    with volread.open_file(path) as f:
        head = f.read(4)
        f.seek(max(0, size - 22))
        tail = f.read(22)
    if head == b"PK\x03\x04":
        return None if len(tail) == 22 and tail.startswith(b"PK\x05\x06") else "is a zip cut short"
    return None if tail.endswith(b".") else "is a pickle cut short (no STOP opcode at its end)"


def _pickles_check(path: Path, files: Mapping[str, Entry], remembered: Remembered = read_now) -> Check:
    name = "accelerate pickles"
    rels = sorted(rel for rel, e in files.items() if e.kind == "f" and _PICKLES.fullmatch(rel))
    failed = files_whole(name, path, files, rels, pickle_problem, "load_state cannot restore it", remembered)
    return failed or Check(name, PASSED, f"{len(rels)} whole" if rels else "none")


class Accelerate(Framework):
    layout = LAYOUT
    last_written = ("random_states_0.pkl", "accelerate", _before_random_states)

    def makes_dir(self, name: str) -> bool:
        return name == "checkpoints"  # automatic_checkpoint_naming: <project_dir>/checkpoints/

    def recognise_contents(self, name: str, children: Collection[str]) -> Candidate | None:
        if (m := _NAME.fullmatch(name)) and any(_MARKER.fullmatch(c) for c in children):
            unit = {"checkpoint": SAVE, "epoch": EPOCH}.get(name.partition("_")[0], STEP)
            return Candidate(name, int(m[1]), LAYOUT, True, unit=unit)
        return None

    def unnamed_save(self, children: Collection[str]) -> bool:
        # `save_state(output_dir="final")` saves into any directory; every process's
        # random_states_<i>.pkl (save_accelerator_state) says one of its saves is there. Its FSDP
        # parts (`pytorch_model_fsdp_0/`, `optimizer_0/`: DCP saves) are then no run's checkpoints.
        return any(_RANDOM_STATES.fullmatch(c) for c in children)

    def evidence(self, save: Save) -> Evidence:
        files = save.files
        checks = [census(save, d)[0] for d in deepspeed_tag_dirs(files)]  # under DeepSpeed: pytorch_model/
        world = known_world(save.world_size, save.mp_world_size)
        rank_check, ranks = rank_files(files, _RANDOM_STATES, world)
        checks.append(rank_check)
        checks.append(copyin.copy_leftovers(files))
        tags = deepspeed_tag_dirs(files)
        checks.append(hfweights.weights_check(save.path, files, who="accelerate", tags=tags))
        if (order := hfweights.weights_order(files, "random_states_0.pkl", "accelerate", tags)) is not None:
            checks.append(order)
        object_check, kinds = _object_files(files)
        checks.append(object_check)
        checks.append(_pickles_check(save.path, files, save.remembered_file))
        return Evidence(checks, ranks, kinds=kinds)

    def tags(self, files: Mapping[str, Entry]) -> list[str]:
        return deepspeed_tag_dirs(files)

    def save_file(self, rel: str) -> bool:
        return bool(_ACCELERATE_FILE.fullmatch(rel) or DS_FILE.fullmatch(rel))

    def written_before(self, rel: str) -> Callable[[str], bool] | None:
        return _before_random_states if _RANDOM_STATES.fullmatch(rel) else None


FRAMEWORK = Accelerate()
