"""accelerate's `Accelerator.save_state()`: `checkpoint_<n>/` (automatic naming), `step_<n>/`, `epoch_<n>/`.

accelerate/checkpointing.py save_accelerator_state, from Accelerator.save_state: the models
(`model.safetensors`, `model_1.safetensors`, ... or `pytorch_model.bin`; FSDP's through
save_fsdp_model; under DeepSpeed each model's tag `pytorch_model[_<i>]/`, DeepSpeed's census), the
optimizers, schedulers, samplers, `scaler.pt`, then each process its `random_states_<i>.pkl`, last.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping

from ckptd.frameworks import copyin, hfweights
from ckptd.frameworks.base import Evidence, Framework, Save, _known_world, _rank_files
from ckptd.frameworks.deepspeed import _DS_FILE, _deepspeed_tag_dirs
from ckptd.layouts import EPOCH, SAVE, STEP, Candidate
from ckptd.model import Entry

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
    return bool(_ACCELERATE_BEFORE.fullmatch(rel) or ("/" in rel and _DS_FILE.fullmatch(rel)))


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

    def evidence(self, save: Save) -> Evidence:
        files = save.files
        checks = [save.deepspeed(d)[0] for d in _deepspeed_tag_dirs(files)]  # under DeepSpeed: pytorch_model/
        world = _known_world(save.world_size, save.mp_world_size)
        rank_check, ranks = _rank_files(files, _RANDOM_STATES, world)
        checks.append(rank_check)
        checks.append(copyin.copy_leftovers(files))
        tags = _deepspeed_tag_dirs(files)
        checks.append(hfweights.weights_check(save.path, files, who="accelerate", tags=tags))
        return Evidence(checks, ranks)

    def tags(self, files: Mapping[str, Entry]) -> list[str]:
        return _deepspeed_tag_dirs(files)

    def save_file(self, rel: str) -> bool:
        return bool(_ACCELERATE_FILE.fullmatch(rel) or _DS_FILE.fullmatch(rel))

    def written_before(self, rel: str) -> Callable[[str], bool] | None:
        return _before_random_states if _RANDOM_STATES.fullmatch(rel) else None


FRAMEWORK = Accelerate()
