"""What ckptd knows about each framework's saves, one module per framework.

A module here owns one framework's save contract (`base.Framework`): what a finished save holds
(its weights in every form the framework writes them, its markers, its rank census), the order it
writes them and which file comes last, what a save cut short looks like, the metrics its files
carry. `hfweights` holds the weight forms the Hugging Face libraries share (transformers'
save_pretrained, accelerate's save_state, PEFT's adapters), and `copyin` what a copier that died
midway leaves; both are used by the frameworks that write them. A framework that saves through
another uses that one's contract (the Trainer and accelerate DeepSpeed's census, NeMo megatron-core's
and Lightning's strategies', torchtitan and megatron-core DCP's).

The registry is closed and ordered: no entry points. Code from outside that could say "complete"
could make ckptd delete. The engine asks `get(layout)` and never compares layout names; recognition
(layouts.py) asks each framework in this order (`NAMES_FIRST`, the user's patterns, `NAMES_AFTER`;
then `BY_CONTENTS`), so a framework's place here is its place in recognition.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from ckptd.frameworks import (
    accelerate,
    composer,
    dcp,
    deepspeed,
    hf,
    keras,
    lightning,
    megatron,
    nemo,
    orbax,
    pattern,
    ray,
    torchtitan,
)
from ckptd.frameworks.base import Framework, OrderProblems, Remembered
from ckptd.frameworks.pattern import EVIDENCE, QUIET_ALONE  # noqa: F401 (the engine's words for quiet alone)
from ckptd.model import Check, Entry

REGISTRY: tuple[Framework, ...] = (
    hf.FRAMEWORK,
    deepspeed.FRAMEWORK,
    megatron.FRAMEWORK,
    orbax.FRAMEWORK,
    accelerate.FRAMEWORK,
    torchtitan.FRAMEWORK,
    composer.FRAMEWORK,
    dcp.FRAMEWORK,
    lightning.FRAMEWORK,
    nemo.FRAMEWORK,
    keras.FRAMEWORK,
    ray.FRAMEWORK,
    pattern.FRAMEWORK,
)
_BY_LAYOUT = {f.layout: f for f in REGISTRY}
USER_PATTERN = pattern.FRAMEWORK  # a user's pattern: what the user names as evidence


def _answers(method: str) -> Callable[[Framework], bool]:
    return lambda f: getattr(type(f), method) is not getattr(Framework, method)


# Who is asked what, in registry order (layouts.recognise_by_name, recognise_by_contents, held).
_by_name = _answers("recognise_name")
NAMES_FIRST = tuple(f for f in REGISTRY if f.names_first)
NAMES_AFTER = tuple(f for f in REGISTRY if not f.names_first and (_by_name(f) or f.file_suffixes))
BY_CONTENTS = tuple(f for f in REGISTRY if _answers("recognise_contents")(f))
TAGS = tuple(f for f in REGISTRY if f.checkpoint_is_tag)  # its checkpoint is itself a DeepSpeed tag
HELD_SUFFIXES = tuple(dict.fromkeys(s for f in REGISTRY for s in f.held_suffixes))
# The weights files a slim may keep, of every framework (weights.WeightsReader reads their headers)
SLIM_WEIGHTS = tuple(dict.fromkeys(w for f in REGISTRY for w in f.slim_weights))
RUN_FILES = tuple(dict.fromkeys(n for f in REGISTRY for n in f.run_files))


def run_key(rel: str) -> str:
    """The run the checkpoints directly in directory `rel` (relative to a root) belong to: the
    first framework that puts one run's launches in directories of their own says so
    (`Framework.run_key`: Lightning's version_N, NeMo's timestamps); else `rel` itself. From the
    path alone, so that discovery, the config's `[[roots.runs]] match`, planning, the reaper's
    re-check and `ckptd latest` all answer alike."""
    for f in REGISTRY:
        if (key := f.run_key(rel)) != rel:
            return key
    return rel


def is_rank_dir(name: str) -> bool:
    """One model-parallel rank's directory (`mp_rank_00`, as a framework names it: `rank_dir`): its
    checkpoints are parts of checkpoints whose other parts are in its sibling rank directories."""
    return any(f.rank_dir(name) for f in REGISTRY)


# A checkpoint name's `name=value` fields, as Lightning's ModelCheckpoint templates (and NeMo's and
# Keras's after them) write them: joined by '-' (ModelCheckpoint._format_checkpoint_name,
# auto_insert_metric_name). A field follows the start or a '-': `warmup_step=100` in a Hydra sweep
# directory (`lr=0.1,warmup_step=100`) is not a step. Values are numbers as Python formats them
# (`-0.40`, `1e-05`, `8000.0`, `nan`, `inf`).
_FIELD = re.compile(
    r"(?:^|-)([A-Za-z_][A-Za-z0-9_.]*)=(-?(?:nan|inf|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?))(?=-|$)"
)


def name_fields(name: str) -> dict[str, str]:
    """The `name=value` fields of a checkpoint name, the extension of a framework's file save
    (`held_suffixes`) removed: `epoch=3-step=40-val_loss=0.52.ckpt` -> {'epoch': '3', 'step': '40',
    'val_loss': '0.52'}."""
    for suffix in HELD_SUFFIXES:
        name = name.removesuffix(suffix)
    return {m[1]: m[2] for m in _FIELD.finditer(name)}


def get(layout: str) -> Framework:
    """The framework whose checkpoints have `layout`; a user pattern's for anything else (nothing
    but what the user named, or quiet, says it is finished)."""
    return _BY_LAYOUT.get(layout, USER_PATTERN)


# Contracts that other frameworks' saves hold inside them, asked of every checkpoint whichever
# framework it is: a DCP directory (torchtitan's steps, Lightning's FSDP `.ckpt/`, megatron-core's
# `iter_N/`) needs its `.metadata` after its `*.distcp`; DeepSpeed's shards (the Trainer's and
# accelerate's checkpoints hold a tag) keep their order. The engine's pass collects the directories
# holding a part (`NESTED_PART_SUFFIX`) or a DCP metadata file (`nested_metadata_file`: every part
# deleted, the metadata still names them) and asks these; it names neither framework.
NESTED_PART_SUFFIX = dcp.DATA_SUFFIX
NESTED_METADATA_SUFFIX = dcp.METADATA_SUFFIX
nested_metadata_file = dcp.is_metadata
# Metrics some frameworks keep inside their files (Lightning's ModelCheckpoint state in a `.ckpt`),
# read once per file identity: the engine keeps one and hands its `read` to `Framework.metrics`.
MetricFileCache = lightning.CkptScores


def nested_checks(
    path: Path, files: Mapping[str, Entry], part_dirs: Iterable[str], skip_top: bool, remembered: Remembered
) -> Iterator[Check]:
    """The checks of the DCP directories inside the checkpoint at `path` (`dcp.nested_metadata`)."""
    return dcp.nested_metadata(path, files, part_dirs, skip_top, remembered)


def order_problems(
    files: Mapping[str, Entry], newest_parts: Mapping[str, tuple[int, str]], tags: Iterable[str]
) -> tuple[tuple[bool, OrderProblems], ...]:
    """For one save's order (`evidence.one_save`): DCP's `.metadata` after each directory's newest
    `*.distcp` (`dcp.metadata_order`), DeepSpeed's optimizer shards after their model states in each
    tag directory (`deepspeed.shard_order`). Each: (whether it found files to compare, problems)."""
    return (dcp.metadata_order(files, newest_parts), deepspeed.shard_order(files, tags))
