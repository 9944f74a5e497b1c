"""MosaicML Composer's CheckpointSaver: `ep{epoch}-ba{batch}-rank0.pt` files, `latest-rank0.pt` symlinks.

The save contract, from Composer 0.32's own code:

- composer/callbacks/checkpoint_saver.py `CheckpointSaver._save_checkpoint` names each save from its
  `filename` template, by default `ep{epoch}-ba{batch}-rank{rank}.pt` in `folder` (`{run_name}/checkpoints`),
  and calls composer/utils/checkpoint.py `save_checkpoint`.
- Unsharded (the default): only global rank 0 writes a file (`_save_checkpoint`: `elif
  dist.get_global_rank() == 0`), so a save is the one `...-rank0.pt`; `_write_checkpoint_file` opens the
  final name (`open(filename, 'wb')`) and `torch.save`s the state into it, in place, not atomically. A
  save killed midway leaves the final name holding a zip without its central directory (torch's writer
  writes it at close). Whole: the zip's end record ends the file and torch's `data.pkl` is a member.
- Sharded (FSDP `state_dict_type='sharded'`): every rank's `__{rank}_0.distcp` and the coordinator's
  `.metadata` in a directory named by `sharded_ckpt_prefix_dir` (by default `ep{epoch}-ba{batch}`), written
  by torch.distributed.checkpoint: DCP's contract (`.metadata` after every rank's data) is its contract.
- After the save returns (and a barrier), `latest-rank{rank}.pt` is removed and made again as a relative
  symlink to the save (to the directory, sharded): what `autoresume=True` and `load_path` of the next
  launch load. Its target is never deleted (`resume_pointers`).
- `save_num_checkpoints_to_keep=N` (`_rotate_checkpoints`) removes the oldest saves of this launch once more
  than N exist, oldest first: `keep_last = N` is the same rule. It counts only the saves of the current
  launch (its list restarts empty with each process unless restored from the state); ckptd counts every
  complete save in the folder.

Its step is the batch (`ba{batch}`, the Trainer's `timestamp.batch`), its epoch beside it. Other templates
(`{sample}`, `{token}`, a name without `ba{batch}`) are not recognised; a user pattern names them. Files of
ranks other than 0 (the unsharded save writes none; a `-rank1.pt` is not Composer's save) are not recognised.
Metrics: Composer keeps a metric's last value in its state only with `Trainer(save_metrics=True)`
(core/state.py `state_dict`: `eval_metrics[label][name]['_computed']`), and its checkpoint pickles numpy's
RNG state beside it, which `torch.load(weights_only=True)` refuses; ckptd unpickles nothing looser
(`dsmeta.load_safely`), so Composer saves carry no metric: `keep_best` does not apply.
"""

from __future__ import annotations

import errno
import os
import re
import zipfile
from collections.abc import Callable, Collection
from pathlib import Path

from ckptd.frameworks import dcp
from ckptd.frameworks.base import Evidence, Framework, Save, pointer_target, unreadable_names_all
from ckptd.frameworks.formats import is_zip
from ckptd.model import Candidate, Check, Verdict
from ckptd.volume import volread

LAYOUT = "composer"
SUFFIX = ".pt"
# CheckpointSaver's default filename, and sharded_ckpt_prefix_dir's default directory name
_FILE = re.compile(r"ep(\d+)-ba(\d+)-rank0\.pt")
_SHARDED_DIR = re.compile(r"ep(\d+)-ba(\d+)")
# CheckpointSaver's default latest_filename, `latest-rank{rank}.pt` (a symlink, made after each save)
_LATEST = re.compile(r"latest-rank\d+\.pt")
LATEST_NOTE = "latest-rank0.pt (Composer's symlink to its newest save: what autoresume and load_path load)"


def torch_zip_problem(path: str, size: int) -> str | None:
    """Why a torch.save zip is not a whole save, or None: its end record ends the file (written at
    close) and torch's pickle (`<archive>/data.pkl`) is a member."""
    if size == 0:
        return "empty"
    if not is_zip(path, size):
        return "not a whole zip archive (torch.save writes its central directory last): a save killed midway?"
    with volread.open_file(path) as f, zipfile.ZipFile(f) as zf:
        names = zf.namelist()
    if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
        return "no data.pkl in the archive: not a torch.save file"
    return None


class Composer(Framework):
    layout = LAYOUT
    names_first = True  # `ep3-ba120-rank0.pt` is unmistakably CheckpointSaver's
    whole_file_formats = ((SUFFIX, "zip"),)

    def recognise_name(self, name: str, is_dir: bool) -> Candidate | None:
        m = (_SHARDED_DIR if is_dir else _FILE).fullmatch(name)
        return None if m is None else Candidate(name, int(m[2]), LAYOUT, is_dir)

    def recognised_inside(self, name: str, children: Collection[str]) -> bool:
        """A sharded save's directory holds DCP's files; an `ep1-ba4/` without them is not Composer's."""
        return dcp.looks_like_dcp(children)

    def evidence(self, save: Save) -> Evidence:
        if save.cand.is_dir:  # sharded: torch.distributed.checkpoint's contract
            return dcp.FRAMEWORK.evidence(save)
        kind = "composer checkpoint (torch.save zip)"
        entry = save.files.get("")
        if entry is None or entry.kind != "f":
            return Evidence([Check(kind, Verdict.FAILED, "not a regular file")])
        try:
            problem = save.remembered_file("", lambda: torch_zip_problem(str(save.path), entry.size))
        except (OSError, zipfile.BadZipFile) as exc:
            return Evidence([Check(kind, Verdict.UNKNOWN, f"cannot be read: {exc}")])
        if problem:
            return Evidence([Check(kind, Verdict.FAILED, f"{problem}; Composer's load_path refuses it")])
        return Evidence([Check(kind, Verdict.PASSED, "whole (central directory written at close, data.pkl in it)")])

    def save_file(self, rel: str) -> bool:
        return rel == "" or dcp.save_file(rel)

    def written_before(self, rel: str) -> Callable[[str], bool] | None:
        return dcp.FRAMEWORK.written_before(rel)

    def resume_pointers(self, run_path: Path, names: Collection[str]) -> dict[str, str]:
        return latest_targets(run_path, names)


def latest_targets(run_path: Path, names: Collection[str]) -> dict[str, str]:
    """What the run's `latest-rank{R}.pt` symlinks name (checkpoint_saver.py: `os.symlink(os.path.relpath(
    src_path, ...), symlink)`), resolved as a pointer is (`pointer_target`). A link that cannot be read
    may name any checkpoint here: every one is named by it. A regular file so named is not a pointer."""
    found: dict[str, str] = {}
    for link in sorted(n for n in names if _LATEST.fullmatch(n)):
        try:
            text = os.readlink(run_path / link)
        except FileNotFoundError:
            continue  # gone since the listing: Composer removes it and links it again after each save
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                continue
            unreadable_names_all(found, names, f"{link} (a symlink that cannot be read: {exc.strerror or exc})")
            continue
        for name in pointer_target(run_path, text):
            if name != link:
                found.setdefault(name, LATEST_NOTE.replace("latest-rank0.pt", link, 1))
    return found


FRAMEWORK = Composer()
