"""Lightning's ModelCheckpoint: `epoch=E-step=S[-val_loss=V].ckpt`, and `last.ckpt`.

lightning/pytorch/callbacks/model_checkpoint.py names the file from its template
(`_format_checkpoint_name`), so its metrics are in the name; a name without the monitored one has it
in the file's `callbacks` state (fwmetrics.CkptScores). A `.ckpt` file is written atomically on one
filesystem (fabric/utilities/cloud_io.py _atomic_save). Its strategies write directories named like
the file: DeepSpeedStrategy's tag `checkpoint/` (DeepSpeed's census), FSDPStrategy's sharded one
(DCP's files, then `meta.pt`). Under NeMo, NeMo's `-unfinished` marker says a save is not finished.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Collection
from pathlib import Path

from ckptd import fwmetrics, layouts
from ckptd.frameworks import nemo
from ckptd.frameworks.base import Evidence, Framework, Metrics, Save, pointer_target, unreadable_names_all
from ckptd.frameworks.megatron import MEGATRON_CORE_METADATA
from ckptd.layouts import Candidate
from ckptd.model import CKPT_STATE, Check, Entry, Reading, Verdict

PASSED, FAILED = Verdict.PASSED, Verdict.FAILED

LIGHTNING_FSDP_META = "meta.pt"


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
    # a `.ckpt` file is a torch.save zip (fabric/utilities/cloud_io.py _atomic_save)
    whole_file_formats = ((".ckpt", "zip"),)

    def evidence(self, save: Save) -> Evidence:
        cand, run = save.cand, save.run
        # NeMo's callback wrote a marker for it, here or (one for every rank) above its rank directory
        if layouts.nemo_unfinished_marker(cand.name) in run.names or layouts.is_rank_dir(run.path.name):
            return Evidence([nemo._nemo_unfinished(run, cand)])
        return Evidence()

    def metrics(self, save: Save, metric: str | None, whole: bool, scores: Callable) -> Metrics:
        return metrics(save, metric, whole, scores)

    def resume_pointers(self, run_path: Path, names: Collection[str]) -> dict[str, str]:
        return last_link_targets(run_path, names)


FRAMEWORK = Lightning()


def last_link_targets(run_path: Path, names: Collection[str]) -> dict[str, str]:
    """The checkpoints a `*last*` symlink of the run names: ModelCheckpoint's `last.ckpt` with
    save_last="link" (a link to the file it saved last, what ckpt_path="last" loads), and NeMo's
    `-last` links (NeMo's callback is a ModelCheckpoint). Deleting the target leaves the link dangling
    and the resume with nothing to load, so it is kept like what a resume pointer names. The link is
    read with os.readlink and resolved as a pointer is (`pointer_target`): only entries of this run
    are named. A link whose target cannot be read may name any checkpoint here: every one is named by it."""
    found: dict[str, str] = {}
    for link in sorted(n for n in names if "last" in n.lower()):
        try:
            text = os.readlink(run_path / link)
        except FileNotFoundError:
            continue  # gone since the listing
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                continue  # not a symlink: a copy, not a pointer
            why = f"{link} (a symlink that cannot be read: {exc.strerror or exc}; it may name any of them)"
            unreadable_names_all(found, names, why)
            continue
        for name in pointer_target(run_path, text):
            if name != link:
                found.setdefault(name, f"{link} (a symlink to it)")
    return found
