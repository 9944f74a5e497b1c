"""NeMo: `<name>--val_loss=V-epoch=E[-step=S].ckpt` / `.nemo`, or a distributed-checkpoint directory.

nemo/utils/callbacks/nemo_model_checkpoint.py writes `<name>-unfinished` before a save and removes it
after (one marker for every model-parallel rank's file, `format_checkpoint_unfinished_marker_path`);
NeMo 1's torch_dist and NeMo 2's `weights/` are megatron-core distributed checkpoints (megatron.py's
contract). A `.ckpt` directory is also what Lightning's DeepSpeed and FSDP strategies write
(lightning.py's contract), judged here as its name is NeMo-like to discovery.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Mapping

from ckptd import frameworks
from ckptd.frameworks import lightning, megatron
from ckptd.frameworks.base import FAILED, PASSED, Evidence, Framework, Metrics, RunContext, Save
from ckptd.frameworks.deepspeed import census, deepspeed_tag_dirs
from ckptd.model import Candidate, Check, Entry

LAYOUT = "nemo"
UNFINISHED_SUFFIX = "-unfinished"
# A model-parallel rank's own directory beside its siblings: NeMo 1 without a distributed
# checkpoint saves each rank's file as <dir>/mp_rank_<tp:02d>/<name>.ckpt, or
# <dir>/tp_rank_<tp:02d>_pp_rank_<pp:03d>/<name>.ckpt with pipeline parallelism, and with an FSDP
# sharded checkpoint <dir>/mp_rank_<tp:02d>_fsdp_shard_<dp:05d>/ or (no model parallelism)
# <dir>/fsdp_shard_<dp:05d>/, under ONE unfinished marker <dir>/<name>-unfinished
# (nemo/utils/app_state.py and get_rank.py inject_model_parallel_rank, uninjected by
# nemo_model_checkpoint.py format_checkpoint_unfinished_marker_path).
_RANK_DIR = re.compile(r"mp_rank_\d+(?:_\d+)?(?:_fsdp_shard_\d+)?|tp_rank_\d+_pp_rank_\d+|fsdp_shard_\d+")
# NeMo 2's `<name>/<%Y-%m-%d_%H-%M-%S>/checkpoints/` (nemo/lightning/nemo_logger.py: the version is the
# launch time, the checkpoints directory under it)
_MADE_DIR = re.compile(r"checkpoints|\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}")


def unfinished_marker(name: str) -> str:
    """NeMo's marker for `name`: the name without .ckpt/.nemo, plus `-unfinished`."""
    return name.removesuffix(".nemo").removesuffix(".ckpt") + UNFINISHED_SUFFIX

def _nemo_unfinished(run: RunContext, cand: Candidate) -> Check:
    """NeMo's `-unfinished` marker, beside the checkpoint; for a model-parallel rank's file
    (`mp_rank_01/<name>.ckpt`), the one marker of every rank's file, in the directory above
    (format_checkpoint_unfinished_marker_path takes the rank out of the path)."""
    marker = unfinished_marker(cand.name)
    if marker in run.names:
        return Check("nemo marker", FAILED, f"{marker} present: save not finished")
    if frameworks.is_rank_dir(run.path.name):
        if os.path.lexists(run.path.parent / marker):
            why = f"../{marker} present (one for every rank's file): save not finished"
            return Check("nemo marker", FAILED, why)
        return Check("nemo marker", PASSED, f"no {marker}, here or above the rank directories")
    return Check("nemo marker", PASSED, f"no {marker}")


# What a NeMo distributed-checkpoint directory holds (NeMo 1: torch_dist; NeMo 2: weights/ + context/).
_NEMO_DIR_MARKERS = frozenset({"weights", "context", "metadata.json", "common.pt", ".metadata"})


class NeMo(Framework):
    layout = LAYOUT
    held_suffixes = (".ckpt", ".nemo")
    # a `.ckpt` file is Lightning's torch.save zip; a `.nemo` a tar (save_restore_connector.py)
    whole_file_formats = ((".ckpt", "zip"), (".nemo", "tar"))

    def recognise_name(self, name: str, is_dir: bool) -> Candidate | None:
        """A name NeMo's template (or, for a directory, any ModelCheckpoint template) writes: a
        distributed-checkpoint directory, a `.nemo` archive, or a `<name>--...ckpt` file; not its
        unfinished marker, not a last copy."""
        if not (is_dir or name.endswith(".nemo") or (name.endswith(".ckpt") and "--" in name)):
            return None
        if name.endswith(UNFINISHED_SUFFIX) or lightning.is_last_copy(name):
            return None
        order = lightning.field_order(name)
        return None if order is None else Candidate(name, order[0], LAYOUT, is_dir, unit=order[1])

    def rank_dir(self, name: str) -> bool:
        return bool(_RANK_DIR.fullmatch(name))

    def makes_dir(self, name: str) -> bool:
        return bool(_MADE_DIR.fullmatch(name))

    def unfinished_marker(self, name: str) -> str | None:
        return unfinished_marker(name)

    def recognised_inside(self, name: str, children: Collection[str]) -> bool:
        """A NeMo-named directory is a checkpoint only named `.ckpt`/`.nemo` or holding what NeMo's
        distributed checkpoints hold."""
        nemo_dir_markers = _NEMO_DIR_MARKERS & set(children) or any(c.endswith(".distcp") for c in children)
        return name.endswith((".ckpt", ".nemo")) or bool(nemo_dir_markers)

    def evidence(self, save: Save) -> Evidence:
        files, path = save.files, save.path
        checks = [_nemo_unfinished(save.run, save.cand)]
        # Lightning's DeepSpeedStrategy: a directory named like the file, the shards in its tag
        # directory `checkpoint/` (save_checkpoint(filepath, tag="checkpoint")): their census.
        for d in deepspeed_tag_dirs(files):
            checks.append(census(save, d)[0])
        lightning_fsdp = lightning._is_lightning_fsdp(save.cand, files)  # DCP's files, Lightning's meta.pt
        if lightning_fsdp:
            checks.append(lightning._lightning_fsdp(files))
        for d in () if lightning_fsdp else ("", "weights"):  # NeMo 1 torch_dist: top; NeMo 2: weights/
            if megatron._is_megatron_core(files, d):
                checks.append(megatron._megatron_core(path, files, d))
        return Evidence(checks)

    def tags(self, files: Mapping[str, Entry]) -> list[str]:
        return deepspeed_tag_dirs(files)  # Lightning's DeepSpeed `<name>.ckpt/checkpoint/`

    def metrics(self, save: Save, metric: str | None, whole: bool, scores: Callable) -> Metrics:
        return lightning.metrics(save, metric, whole, scores)

    def run_key(self, rel: str) -> str:
        """`<exp_dir>/<name>/<%Y-%m-%d_%H-%M-%S>/checkpoints` -> `<exp_dir>/<name>`: NeMo's logger
        names each launch's log directory by the time it started when no version is given (NeMo 1
        exp_manager's get_log_dir, NeMo 2's NeMoLogger use_datetime_version), its checkpoints in
        `checkpoints/` below it. Another directory is its own run."""
        parts = rel.split("/")
        if len(parts) < 3 or parts[-1] != lightning.CKPT_SUBDIR or not _LAUNCH_TIME.fullmatch(parts[-2]):
            return rel
        return "/".join(parts[:-2])


_LAUNCH_TIME = re.compile(r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}")

FRAMEWORK = NeMo()
