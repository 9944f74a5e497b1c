"""Metric values the frameworks record with their checkpoints. Reads only.

The Trainer logs its metrics in `trainer_state.json` (read with the completeness evidence, in
`evidence.py`). The others keep them with each checkpoint, and `keep_best` needs them:
- Lightning and NeMo put them in the file name when the template names them
  (`epoch=3-step=40-val_loss=0.52.ckpt`, `megatron_gpt--val_loss=2.3456-epoch=3.ckpt`), rounded as
  the template formats them;
- Lightning also keeps, inside every `.ckpt`, its ModelCheckpoint callback's state
  (`ckpt["callbacks"]["ModelCheckpoint{'monitor': 'val_loss', ...}"]`): `best_k_models` maps each
  file it saved (absolute paths, as written) to its score, a 0-d tensor, and is updated *before*
  the file is written (lightning/pytorch/callbacks/model_checkpoint.py `_update_best_and_save`),
  so the file is listed in its own state. `current_score` is not used: a second callback (one
  without a monitor) stores the first one's `current_score` from an earlier save in its own files;
- Orbax writes the metrics given to `CheckpointManager.save(step, metrics=...)` as JSON in
  `<step>/metrics/metrics` (checkpoint_manager.py `METRIC_ITEM_NAME`), what its `best_fn` ranks.

Reading a `.ckpt` needs torch (`torch.load(weights_only=True, mmap=True)`, lazily imported, as
`dsmeta.load_safely` does): it is done only when the metric is not in the file name, only for a
file whose zip is whole, once per (path, size, mtime), and never decides completeness. Without
torch the value is missing and `plan` says why.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ckptd import dsmeta, volread
from ckptd.layouts import name_fields
from ckptd.model import FILE_NAME, ORBAX_METRICS, Reading, as_metric

ORBAX_METRICS_FILE = "metrics/metrics"
MAX_METRICS_BYTES = 1024 * 1024

Readings = tuple[tuple[str, Reading], ...]


def from_name(name: str) -> Readings:
    """The numeric fields of a Lightning/NeMo checkpoint name (step and epoch included)."""
    return tuple((k, Reading(float(v), FILE_NAME)) for k, v in name_fields(name).items())


def from_orbax(path: Path) -> tuple[Readings, str | None]:
    """Orbax's metrics item (`<step>/metrics/metrics`), or why it cannot be read."""
    try:
        with volread.open_file(path / ORBAX_METRICS_FILE) as f:
            doc = json.loads(f.read(MAX_METRICS_BYTES + 1))
    except (OSError, ValueError, RecursionError) as exc:
        return (), f"{ORBAX_METRICS_FILE} unreadable: {type(exc).__name__}: {exc}"
    if not isinstance(doc, dict):
        return (), f"{ORBAX_METRICS_FILE} is not a JSON object"
    return tuple((str(k), Reading(as_metric(v), ORBAX_METRICS)) for k, v in doc.items()), None


class CkptScores:
    """Lightning's ModelCheckpoint scores inside `.ckpt` files, remembered per (path, size, mtime,
    ctime): a file rewritten in place with its mtime kept still changes its ctime."""

    MAX_CACHE = 4096

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int, int, int], dict[str, float] | str] = {}

    def read(self, path: Path, size: int, mtime_ns: int, ctime_ns: int) -> dict[str, float] | str:
        """{monitor: this file's score} for each ModelCheckpoint that lists the file, or why not."""
        key = (str(path), size, mtime_ns, ctime_ns)
        if key not in self._cache:
            if len(self._cache) > self.MAX_CACHE:  # files rewritten leave stale keys behind
                self._cache.clear()
            self._cache[key] = ckpt_scores(path)
        return self._cache[key]


def ckpt_scores(path: Path) -> dict[str, float] | str:
    """The score each ModelCheckpoint callback recorded for this very file, by its monitor."""
    try:
        ckpt = dsmeta.load_safely(path)  # torch.load(weights_only=True, mmap=True); MetadataUnavailable
    except dsmeta.MetadataUnavailable as exc:
        return str(exc)
    callbacks = ckpt.get("callbacks")
    if not isinstance(callbacks, dict):
        return "it holds no callback state"
    scores: dict[str, float] = {}
    for state in callbacks.values():
        if not (isinstance(state, dict) and isinstance(state.get("monitor"), str)):
            continue
        best_k = state.get("best_k_models")
        for saved, score in best_k.items() if isinstance(best_k, dict) else ():
            # Paths are absolute as written: the volume may be mounted elsewhere now.
            if isinstance(saved, str) and os.path.basename(saved) == path.name:
                value = _number(score)
                if value is not None:
                    scores[state["monitor"]] = value
    if not scores:
        return "no ModelCheckpoint with a monitor lists this file in its state"
    return scores


def _number(score: object) -> float | None:
    """A 0-d tensor (or a plain number) as a float."""
    if isinstance(score, int | float) and not isinstance(score, bool):
        return float(score)
    numel = getattr(score, "numel", None)
    if callable(numel) and numel() == 1:
        try:
            value = float(score.item())  # type: ignore[attr-defined]
        except (TypeError, ValueError, RuntimeError):
            return None
        return value
    return None
