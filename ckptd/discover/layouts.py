"""Recognising checkpoints by name and shape: the generic part, asking each framework in turn.

Pure: each function gets names (an entry, its siblings, its children) and
answers whether it is a checkpoint, of which layout, at which step. Anything
not recognised here is never touched. What a framework's saves are called and
hold is its own module's (`frameworks/<name>.py`: `recognise_name`,
`recognise_contents`); here is only the order they are asked in, the user's
patterns between them, and the rule that a directory holding checkpoints is a
run, not one checkpoint.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Collection
from dataclasses import replace

from ckptd import frameworks
from ckptd.frameworks.base import Framework
from ckptd.model import STEP, TIME, Candidate

PIN_FILE = ".ckptd-keep"
TRASH_DIR = ".ckptd-trash"
# A checkpoint renamed into its root when the trash could not be made (a full disk): purged as trash
HIDDEN_TRASH = f"{TRASH_DIR}."
LEASE_DIR = ".ckptd"  # the volume lease (lease.py)
# Made by every ckptd that deletes in a root (locks.RootLock), and only in a root: a checkpoint's own
# `.ckptd/` holds commit records (attest.RECORD_DIR), never this
ROOT_LOCK_FILE = f"{LEASE_DIR}/local.lock"

# A user pattern's fields and wildcards (config `Pattern.name`): `{step}` a number, `{time}` a date
# and time written year first (`2024-05-01_12-00-00.000000`, `20240501-120000`, a Unix time),
# `*` any run of characters within the name, `?` one character.
_PATTERN_TOKENS = re.compile(r"(\{step\}|\{time\}|\*|\?)")
_PATTERN_REGEX = {
    "{step}": r"(?P<step>\d+)",
    "{time}": r"(?P<time>\d(?:[\d_:.T-]*\d)?)",
    "*": r"[^/]*?",
    "?": r"[^/]",
}


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """`ckpt_{step}`, `ep*-ba{step}-rank0.pt`, `checkpoint_{time}` -> a regex matching the whole
    name, the step (or the time) captured by name."""
    parts = _PATTERN_TOKENS.split(pattern)
    return re.compile("".join(_PATTERN_REGEX.get(p, re.escape(p)) for p in parts))


def pattern_step(m: re.Match[str]) -> tuple[int, str]:
    """A pattern's match (`compile_pattern`) as (the number that orders the run, what it counts):
    the step, or the time's digits in order (year first, so later is larger; its fields at a
    fixed width, as strftime writes them)."""
    found = m.groupdict()
    if found.get("step") is not None:
        return int(found["step"]), STEP
    return int(re.sub(r"\D", "", found["time"])), TIME


def framework(layout: str) -> Framework:
    """`layout`'s framework: what it says of its own names and parts."""
    return frameworks.get(layout)


def recognise_by_name(
    name: str, is_dir: bool, patterns: Collection[re.Pattern[str]] = ()
) -> Candidate | None:
    """Layouts that a name alone identifies: the frameworks whose names are their own first
    (`names_first`: `checkpoint-<N>/` is the Trainer's whatever a pattern says), then the user's
    patterns, then the others, each in registry order."""
    for f in frameworks.NAMES_FIRST:
        if (cand := f.recognise_name(name, is_dir)) is not None:
            return cand
    for i, regex in enumerate(patterns):
        if m := regex.fullmatch(name):
            step, unit = pattern_step(m)
            return Candidate(name, step, frameworks.USER_PATTERN.layout, is_dir, pattern=i, unit=unit)
    for f in frameworks.NAMES_AFTER:
        if (cand := f.recognise_name(name, is_dir)) is not None:
            return cand
    return None


def recognise_among(names: Collection[str]) -> list[Candidate]:
    """The checkpoints among the files `names` of one directory that no name alone identified
    (`recognise_by_name` said None for each), asked of each framework (`recognise_among`): saves of
    one template that only their siblings show to be a run."""
    found: list[Candidate] = []
    left = set(names)
    for f in frameworks.REGISTRY:
        for cand in f.recognise_among(sorted(left)):
            found.append(cand)
            left.discard(cand.name)
    return found


def recognise_with_siblings(
    name: str, is_dir: bool, siblings: Collection[str], patterns: Collection[re.Pattern[str]] = ()
) -> Candidate | None:
    """`recognise_by_name`, else what `name` is among the files `siblings` of its directory
    (`recognise_among`, with `name` among them)."""
    cand = recognise_by_name(name, is_dir, patterns)
    if cand is not None or is_dir:
        return cand
    loose = {n for n in siblings if recognise_by_name(n, False, patterns) is None} | {name}
    return next((c for c in recognise_among(loose) if c.name == name), None)


def recognise_by_contents(name: str, children: Collection[str]) -> Candidate | None:
    """Layouts that need a look inside (DCP, finalized Orbax and accelerate directories), each
    framework asked in registry order: a numeric directory is an Orbax step only with Orbax's own
    files in it, so a run or team directory that happens to be called `42` is never mistaken for
    a checkpoint."""
    for f in frameworks.BY_CONTENTS:
        if (cand := f.recognise_contents(name, children)) is not None:
            return cand
    return None


def unnamed_save(children: Collection[str]) -> str | None:
    """The framework whose save a directory holding `children` is, whatever its name
    (`unnamed_save`: accelerate's `save_state(output_dir=...)`), or None."""
    return next((f.layout for f in frameworks.REGISTRY if f.unnamed_save(children)), None)


def is_framework_dir(name: str) -> bool:
    """A directory a framework makes on the way to its checkpoints (not counted against max_depth)."""
    return any(f.makes_dir(name) for f in frameworks.REGISTRY)


def unfinished_markers(name: str) -> set[str]:
    """The names of the markers a framework puts beside `name` while saving it (`unfinished_marker`)."""
    return {m for f in frameworks.REGISTRY if (m := f.unfinished_marker(name)) is not None}


def resume_copy(name: str) -> str | None:
    """Why `name` is a copy a framework's resume loads and rewrites at each save (never a step of
    its own, never deleted), or None (`resume_copy`)."""
    return next((why for f in frameworks.REGISTRY if (why := f.resume_copy(name)) is not None), None)


def held(layout: str, rels: Collection[str], dirs: Collection[str]) -> list[str]:
    """What a checkpoint directory of `layout` holds that is not its own part, as paths relative
    to it: checkpoints of a run of its own, at any depth, recognised as discovery recognises
    them (a job given `--output_dir out/checkpoint-500` writes checkpoint-100, -200 inside it;
    an Orbax CheckpointManager directory named like a user pattern holds its numbered steps),
    and pins below its top (`.ckptd-keep`, or a file's `<name>.ckptd-keep`); the copies a nested
    run resumes from too (`resume_copy`: Lightning's `last.ckpt`). Such a directory is never
    deleted as one checkpoint. `rels`: everything in it, relative to it, and `dirs`: the
    directories among them, from the walk evidence makes anyway: no extra I/O. Files are looked
    at only where a framework's saves are files a run may hold (`held_suffixes`).

    Its own parts are not counted: a DeepSpeed tag directory directly in a checkpoint that is
    not itself one (`checkpoint_is_tag`), its items directly in a step where they look like
    steps (`items_like_steps`), and what a framework calls a part when found inside another
    checkpoint (`part_inside`: FSDP's `pytorch_model_fsdp_0/` DCP directory). Parts of a held
    checkpoint are not listed again.
    """
    held_files = (*frameworks.HELD_SUFFIXES, PIN_FILE)
    items = sorted([(d, True) for d in dirs if d] + [(f, False) for f in rels if f.endswith(held_files)])
    tree = _Tree(rels, dirs)
    own = framework(layout)
    found: list[str] = []
    seen: set[str] = set()
    for rel, is_dir in items:
        if _inside_listed(rel, seen):
            continue  # a part of a checkpoint already listed
        if _is_held(rel, is_dir, own, tree):
            found.append(rel)
            seen.add(rel)
    return found


class _Tree:
    """A checkpoint directory's entries from its walk (`rels`, `dirs` among them), each directory's
    children listed once, and only if a directory's name is not enough."""

    def __init__(self, rels: Collection[str], dirs: Collection[str]) -> None:
        self.rels = rels
        self.dir_set = set(dirs)
        self.kids: dict[str, list[str]] | None = None

    def children(self, rel: str) -> list[str]:
        if self.kids is None:
            self.kids = {}
            for r in self.rels:
                if r:
                    parent, _, name = r.rpartition("/")
                    self.kids.setdefault(parent, []).append(name)
        return self.kids.get(rel, [])

    def dir_names(self, parent: str) -> set[str]:
        return {c for c in self.children(parent) if (f"{parent}/{c}" if parent else c) in self.dir_set}


def _inside_listed(rel: str, seen: Collection[str]) -> bool:
    """Whether `rel` lies in a directory already listed as held."""
    parent = rel.rpartition("/")[0]
    if seen and parent:
        parts = parent.split("/")
        return any("/".join(parts[: i + 1]) in seen for i in range(len(parts)))
    return False


def _is_held(rel: str, is_dir: bool, own: Framework, tree: _Tree) -> bool:
    """Whether the entry `rel` of a checkpoint of the framework `own` is held (`held`): a pin below
    its top, a nested run's resume copy, or a checkpoint that is not its own part."""
    parent, _, name = rel.rpartition("/")
    if name.endswith(PIN_FILE):
        return bool(parent) or name != PIN_FILE  # `.ckptd-keep` at its top pins the checkpoint itself
    if not is_dir and not name.endswith(frameworks.HELD_SUFFIXES):
        return False  # only the frameworks' file saves are files
    tag = not parent and is_dir and not own.checkpoint_is_tag
    if tag and any(f.recognise_name(name, True) for f in frameworks.TAGS):
        return False  # its own DeepSpeed tag (the Trainer's global_stepN/), the common case: no more to do
    cand = recognise(name, is_dir, lambda: tree.children(rel))
    if cand is None and name.endswith(frameworks.HELD_SUFFIXES) and resume_copy(name) is not None:
        return True  # a nested run's last.ckpt: what its resume loads
    if cand is None:
        return False
    if framework(cand.layout).part_inside(name, lambda: tree.dir_names(parent)):
        return False  # its own part (FSDP's pytorch_model_fsdp_0/), whose .metadata the evidence demands
    # an Orbax item (its own commit_success.txt, in commit-file mode) is its own part
    item = not parent and own.items_like_steps and framework(cand.layout) is own and not cand.in_progress
    return not item


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
    if cand is not None and (framework(cand.layout).named_alone or cand.in_progress):
        return cand
    inside = children()
    if cand is None:
        cand = recognise_by_contents(name, inside)
    elif cand.pattern is not None and (known := recognise_by_contents(name, inside)) is not None:
        # A user's pattern over a save a framework recognises by its own files (accelerate's step_10/):
        # that framework's evidence, not quiet alone; the pattern's own evidence is asked besides.
        cand = replace(known, pattern=cand.pattern)
    if cand is None:
        return None
    if not framework(cand.layout).recognised_inside(name, inside):
        return None
    if any(recognise_by_name(c, True, patterns) for c in inside):
        return None
    return cand


# Names that lived here before their frameworks' modules had them: still importable from here
# (evidence.py's `layouts.MEGATRON_TRACKER`) until their last users ask the module itself.
_MOVED = {"MEGATRON_TRACKER": ("ckptd.frameworks.megatron", "TRACKER")}


def __getattr__(attr: str):
    if attr in _MOVED:
        module, name = _MOVED[attr]
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
