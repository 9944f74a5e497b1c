"""Lightning's ModelCheckpoint: `epoch=E-step=S[-val_loss=V].ckpt`, and `last.ckpt`.

lightning/pytorch/callbacks/model_checkpoint.py names the file from its template
(`_format_checkpoint_name`), so its metrics are in the name; a name without the monitored one has it
in the file's `callbacks` state (fwmetrics.CkptScores). A `.ckpt` file is written atomically on one
filesystem (fabric/utilities/cloud_io.py _atomic_save). Its strategies write directories named like
the file: DeepSpeedStrategy's tag `checkpoint/` (DeepSpeed's census), FSDPStrategy's sharded one
(DCP's files, then `meta.pt`). Under NeMo, NeMo's `-unfinished` marker says a save is not finished.

Its run is the experiment, not one launch's directory (`run_key`): every `Trainer.fit` with a
logger writes into a new `<save_dir>/<name>/version_N/checkpoints/`, a fit resumed with `ckpt_path`
included.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ckptd import fwmetrics, layouts
from ckptd.frameworks import nemo
from ckptd.frameworks.base import Evidence, Framework, Metrics, Save
from ckptd.frameworks.megatron import MEGATRON_CORE_METADATA
from ckptd.layouts import Candidate
from ckptd.model import CKPT_STATE, Check, Entry, Reading, Verdict

PASSED, FAILED = Verdict.PASSED, Verdict.FAILED

LIGHTNING_FSDP_META = "meta.pt"

# ModelCheckpoint's directory without a dirpath (lightning/pytorch/callbacks/model_checkpoint.py
# __resolve_ckpt_dir): os.path.join(save_dir, str(name), f"version_{version}", "checkpoints") of
# the first logger, where `version` is the next free number when none is given
# (loggers/tensorboard.py and fabric/loggers/csv_logs.py _get_next_version: max(version_N) + 1);
# a string version is used as it is, and is not a launch of a run that ckptd can tell.
_LAUNCH = re.compile(r"version_\d+")
CKPT_SUBDIR = "checkpoints"
DEFAULT_NAME = "lightning_logs"  # the loggers' default `name` (TensorBoardLogger, CSVLogger)


def run_key(rel: str) -> str:
    """`<exp>/lightning_logs/version_N/checkpoints` -> `<exp>` (the Trainer's default_root_dir, as a
    user names the experiment), `<save_dir>/<name>/version_N/checkpoints` -> `<save_dir>/<name>`
    (a logger's own name), `<save_dir>/version_N/checkpoints` -> `<save_dir>` (name=""); any other
    directory is its own run."""
    parts = rel.split("/")
    if len(parts) < 2 or parts[-1] != CKPT_SUBDIR or not _LAUNCH.fullmatch(parts[-2]):
        return rel
    above = parts[:-2]
    if above and above[-1] == DEFAULT_NAME:
        above = above[:-1]
    return "/".join(above) or "."


def _is_lightning_fsdp(cand: Candidate, files: dict[str, Entry]) -> bool:
    """Whether a `.ckpt` directory is Lightning FSDPStrategy's sharded checkpoint: DCP's files, then
    rank 0's `meta.pt` (lightning/pytorch/strategies/fsdp.py save_checkpoint), and none of
    megatron-core's own files (common.pt, written first; metadata.json)."""
    return (
        cand.name.endswith(".ckpt")
        and LIGHTNING_FSDP_META in files
        and not any(n in files for n in ("common.pt", MEGATRON_CORE_METADATA))
    )


def _lightning_fsdp(files: dict[str, Entry]) -> Check:
    """Lightning's FSDP sharded checkpoint is whole once DCP's `.metadata` (the coordinator writes it
    after every rank's data) and `meta.pt` (rank 0 writes it after the DCP save returns) are there."""
    name = "lightning fsdp (dcp .metadata, meta.pt)"
    if ".metadata" not in files:
        return Check(name, FAILED, "dcp .metadata missing (the coordinator writes it after every rank)")
    if files[LIGHTNING_FSDP_META].kind != "f":
        return Check(name, FAILED, f"{LIGHTNING_FSDP_META} is not a file")
    return Check(name, PASSED, f".metadata and {LIGHTNING_FSDP_META} present (written after DCP's save)")



def metrics(save: Save, metric: str | None, whole: bool, scores: Callable) -> Metrics:
    """Its metrics from its name, else (a `.ckpt` file whose name lacks `metric`) from ModelCheckpoint's
    state inside it."""
    cand, files, path = save.cand, save.files, save.path
    found = fwmetrics.from_name(cand.name)
    named = metric is None or any(n == metric for n, _ in found)
    if named or cand.is_dir or not cand.name.endswith(".ckpt") or not whole:
        return found, None  # a file cut short: nothing to read, and no reason to import torch for it
    entry = files[""]
    read = scores(path, entry.size, entry.mtime_ns, entry.ctime_ns)
    if isinstance(read, str):
        return found, (
            f"{metric} is not in its name, and Lightning's ModelCheckpoint state in it "
            f"cannot be read: {read}"
        )
    extra = tuple((k, Reading(v, CKPT_STATE)) for k, v in read.items() if k not in dict(found))
    return found + extra, None


class Lightning(Framework):
    layout = layouts.LIGHTNING

    def evidence(self, save: Save) -> Evidence:
        cand, run = save.cand, save.run
        # NeMo's callback wrote a marker for it, here or (one for every rank) above its rank directory
        if layouts.nemo_unfinished_marker(cand.name) in run.names or layouts.is_rank_dir(run.path.name):
            return Evidence([nemo._nemo_unfinished(run, cand)])
        return Evidence()

    def metrics(self, save: Save, metric: str | None, whole: bool, scores: Callable) -> Metrics:
        return metrics(save, metric, whole, scores)

    def run_key(self, rel: str) -> str:
        return run_key(rel)


FRAMEWORK = Lightning()
