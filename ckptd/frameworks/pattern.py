"""A user's pattern (`[[roots.patterns]] name = "ckpt_{step}"`): the evidence the user names for it,
and the whole-file checks the framework modules make, which no `require` can overrule.

`require` globs each a file that must be there, `ranks` a per-rank file with `{rank}` (counted as
the frameworks' rank files are). Without either, nothing but quiet says a save is finished, and
`plan` warns so.

Whatever the user requires, a save in a pattern's directory is also judged as a framework module
judges its files (the engine checks every torch zip's and safetensors header's end already):
- sharded weights, as transformers' `save_pretrained` writes them (modeling_utils.py: each
  `<name>-0000i-of-0000N.safetensors` shard, then the `.index.json` naming them, last): every
  shard of N there, an index beside them, and every file an index names there. A save killed
  between two shards meets `require = ["config.json", "*.safetensors"]`, and `from_pretrained`
  refuses it;
- every JSON file parses (a config, an index, a trainer state cut short is not whole);
- every pickle ends with pickle's STOP opcode (`.`), which `pickle.dump` writes last;
- a transformers model's `config.json` with no weights file beside it is a `save_pretrained` killed
  after its config (it writes the config first, then the weights);
- every zip or tar archive whole whatever its suffix, told by its first bytes: torch.save writes a
  zip into whatever name it is given (PyTorch's own tutorial names its checkpoints `.tar`), and the
  engine reads the end only of `.pt`, `.pth`, `.bin` and the modules' own suffixes. A pattern over
  single files whose file is empty is no save (torch.save's `open(f, "wb")` before its first write).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from ckptd.frameworks.accelerate import pickle_problem  # its random_states pickles'
from ckptd.frameworks.base import (
    FAILED,
    PASSED,
    Evidence,
    Framework,
    Save,
    files_whole,
    known_world,
    matches,
    rank_files,
)
from ckptd.frameworks.formats import SAFETENSORS_SUFFIX, ZIP_SUFFIXES, is_zip, tar_problem
from ckptd.frameworks.hf import json_problem  # the Trainer's JSON files'
from ckptd.frameworks.hfweights import index_shards
from ckptd.model import Check, Entry
from ckptd.volume import volread

LAYOUT = "pattern"
EVIDENCE = "evidence"
SHARDS = "sharded weights"
WHOLE = "whole files"
QUIET_ALONE = "no completion evidence: complete on quiet alone, the weakest evidence there is"

# transformers' shard names (utils/hub.py, huggingface_hub's split_torch_state_dict_into_shards:
# `model-00001-of-00004.safetensors`, a variant before the suffix) and their indexes
# (`model.safetensors.index.json`, `model.safetensors.index.fp16.json`)
_SHARD = re.compile(r"(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.(?P<ext>safetensors|bin)")
_INDEX = re.compile(r".+\.(?:safetensors|bin)\.index(?:\.[^/]+)?\.json")
_PICKLE_SUFFIXES = (".pkl", ".pickle")
_LOADERS_FAIL = "json.load and pickle.load fail on it"
ARCHIVES = "whole archives"
_ZIP_MAGIC = b"PK\x03\x04"  # a zip's first local header: where torch.save's writer starts
_TAR_MAGIC = (257, b"ustar")  # POSIX tar's header magic


def _read_elsewhere() -> tuple[str, ...]:
    """The suffixes whose end the engine's integrity check reads already (evidence._CHECKED_SUFFIXES and
    the modules' whole_file_formats), and those whole_files reads whole."""
    from ckptd.frameworks import REGISTRY  # imported here: the registry imports this module

    whole_file = (suffix for fw in REGISTRY for suffix, _ in fw.whole_file_formats)
    return (*ZIP_SUFFIXES, SAFETENSORS_SUFFIX, *whole_file, ".json",
            *_PICKLE_SUFFIXES)


def _required(files: dict[str, Entry], glob: str) -> Check:
    """A file the user's pattern requires (`require`)."""
    hit = next((rel for rel, e in files.items() if e.kind == "f" and rel and matches(rel, glob)), None)
    if hit is None:
        return Check(f"requires {glob}", FAILED, "no such file")
    return Check(f"requires {glob}", PASSED, f"{hit} present")


def _present(files: Mapping[str, Entry], rel: str) -> bool:
    e = files.get(rel)
    return e is not None and e.kind == "f"


def _split(rel: str) -> tuple[str, str]:
    head, _, tail = rel.rpartition("/")
    return head, tail


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def sharded_weights(path: Path, files: Mapping[str, Entry]) -> Check | None:
    """Every set of `-0000i-of-0000N` shards whole, with an index beside it naming every file it
    lists; None where the save holds no shards and no index."""
    sets: dict[tuple[str, str, int, str], set[int]] = defaultdict(set)
    for rel, e in files.items():
        folder, name = _split(rel)
        if e.kind == "f" and (m := _SHARD.fullmatch(name)):
            sets[(folder, m["stem"], int(m["n"]), m["ext"])].add(int(m["i"]))
    indexes = sorted(rel for rel, e in files.items() if e.kind == "f" and _INDEX.fullmatch(_split(rel)[1]))
    if not sets and not indexes:
        return None
    named: dict[str, set[str]] = defaultdict(set)  # folder -> the files its indexes name
    for index in indexes:
        shards = index_shards(path, files, index)
        if isinstance(shards, str):
            return Check(SHARDS, FAILED, shards)
        folder = _split(index)[0]
        missing = [s for s in shards if not _present(files, _join(folder, s))]
        if missing:
            n = len(shards)
            why = f"{_join(folder, missing[0])} missing ({n - len(missing)}/{n} named by {index})"
            return Check(SHARDS, FAILED, why)
        named[folder].update(shards)
    for (folder, stem, n, ext), have in sorted(sets.items()):
        first = _join(folder, f"{stem}-{1:05d}-of-{n:05d}.{ext}")
        if absent := [i for i in range(1, n + 1) if i not in have]:
            gone = _join(folder, f"{stem}-{absent[0]:05d}-of-{n:05d}.{ext}")
            return Check(SHARDS, FAILED, f"{gone} missing ({n - len(absent)}/{n} shards): a save killed "
                                         "between its shards (save_pretrained writes them one by one)")
        if not any(name.startswith(f"{stem}-") for name in named[folder]):
            return Check(SHARDS, FAILED, f"no index naming {first} and its {n - 1} siblings: save_pretrained "
                                         "writes the index after the last shard")
    count = sum(len(v) for v in sets.values())
    return Check(SHARDS, PASSED, f"{count} shards, each set whole and named by {', '.join(indexes)}")


def whole_files(save: Save) -> Check | None:
    """Every JSON file parses and every pickle ends as pickle.dump ends it, judged as the Trainer's
    and accelerate's modules judge theirs; None where there are none. Each file is read once while
    it stays the same (`Save.remembered_file`)."""
    files = save.files
    # a pattern over single files: the checkpoint is the file, its entry ""
    name = {rel: rel or save.path.name for rel, e in files.items() if e.kind == "f"}
    jsons = sorted(rel for rel, n in name.items() if n.endswith(".json"))
    pickles = sorted(rel for rel, n in name.items() if n.endswith(_PICKLE_SUFFIXES))
    if not jsons and not pickles:
        return None
    for rels, problem in ((jsons, json_problem), (pickles, pickle_problem)):
        failed = files_whole(WHOLE, save.path, files, rels, problem, _LOADERS_FAIL, save.remembered_file)
        if failed is not None:
            return failed
    return Check(WHOLE, PASSED, f"{len(jsons)} JSON and {len(pickles)} pickle files whole")


def archive_problem(path: Path, size: int) -> str | None:
    """Why a file whose first bytes say it is a zip (torch.save's, whatever its suffix) or a tar is
    not whole, or None (any other file: nothing known about it)."""
    if size == 0:
        return None
    fd = volread.open_regular(path)
    try:
        head = os.pread(fd, _TAR_MAGIC[0] + len(_TAR_MAGIC[1]), 0)
    finally:
        os.close(fd)
    if head.startswith(_ZIP_MAGIC):
        return None if is_zip(path, size) else (
            "is a zip archive (torch.save's, whatever its suffix) without its end record: a save killed "
            "midway?")
    if head[_TAR_MAGIC[0]:] == _TAR_MAGIC[1]:
        return None if (why := tar_problem(path, size)) is None else f"is a tar archive: {why}"
    return None


def whole_archives(save: Save) -> Check | None:
    """Every file the other checks do not read whose first bytes make it a zip or a tar, whole
    (`archive_problem`); a pattern's single-file save not empty. None where there is none to read."""
    files = save.files
    single = files.get("")
    if single is not None and single.kind == "f" and single.size == 0:
        return Check(ARCHIVES, FAILED, "the file is empty: a save's first write never came (torch.save opens "
                                       "the final name, then writes)")
    elsewhere = _read_elsewhere()
    rels = sorted(rel for rel, e in files.items()
                  if e.kind == "f" and not (rel or save.path.name).endswith(elsewhere))
    if not rels:
        return None
    failed = files_whole(ARCHIVES, save.path, files, rels, archive_problem,
                         "torch.load and tarfile fail on it", save.remembered_file)
    if failed is not None:  # a single file's rel is "": its name says which
        return Check(failed.name, failed.verdict, failed.detail.strip()) if single is None else Check(
            failed.name, failed.verdict, f"{save.path.name}{failed.detail}")
    return Check(ARCHIVES, PASSED, f"{len(rels)} other file(s): no zip or tar among them cut short")


_CONFIG = "config.json"  # save_pretrained writes it first (modeling_utils.py), then the weights
_WEIGHTS = "model weights"
# what a save's weights could be in, in any framework's format: a save with one of these, or a
# directory, is not judged by `config_without_weights`
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".hdf5", ".keras", ".msgpack",
                    ".gguf", ".npz", ".npy", ".distcp", ".pkl", ".pickle", ".tar", ".nemo", ".onnx", ".ot")


def config_without_weights(save: Save) -> Check | None:
    """A transformers model's `config.json` (a JSON object with its `model_type`) and no file its weights
    could be in, nor a directory: `save_pretrained` killed after its config, before its first weights
    (from_pretrained: "no file named model.safetensors"). None where there is no such config, or a
    file or directory the weights could be in (the shard and whole-file checks judge those)."""
    files = save.files
    if _CONFIG not in files or files[_CONFIG].kind != "f":
        return None
    if any(rel and (e.kind != "f" or rel.endswith(_WEIGHT_SUFFIXES)) for rel, e in files.items()):
        return None
    try:
        doc = json.loads(volread.read_bytes(save.path / _CONFIG, _MAX_CONFIG_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return None  # whole_files says it is not whole, or it cannot be read now
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        return None
    return Check(_WEIGHTS, FAILED, f"a {doc['model_type']} model's {_CONFIG} and no weights beside it: "
                                   "save_pretrained writes its config first and its weights after "
                                   "(from_pretrained refuses it)")


_MAX_CONFIG_BYTES = 1024 * 1024


def run_records(save: Save) -> list[Check | None]:
    """What a framework's own records in the run directory say of the save (`Framework.run_evidence`:
    Ray's snapshot, the commit of every checkpoint in its run directory, whatever names it)."""
    from ckptd.frameworks import REGISTRY  # imported here: the registry imports this module

    return [fw.run_evidence(save) for fw in REGISTRY]


# What a save killed between its shards holds, and the index written after them
_PARTIAL_SHARDS = ("model-00001-of-00002.safetensors", "pytorch_model-00001-of-00002.bin")
_INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def partial_requires(require: tuple[str, ...]) -> list[str]:
    """The `require` globs a save killed between its shards could meet (`*.safetensors` meets one
    shard of four) where no other glob requires an index, each with why (`check-config` warns)."""
    if any(matches(index, glob) for index in _INDEX_NAMES for glob in require):
        return []
    return [
        f"require {glob!r} could be met by a partial save ({shard}: save_pretrained writes its shards one "
        "by one, the index last): require the index too (e.g. 'model.safetensors.index.json'); ckptd "
        "checks shards and indexes whatever require says"
        for glob in require
        if (shard := next((n for n in _PARTIAL_SHARDS if matches(n, glob)), None)) is not None
    ]


class UserPattern(Framework):
    layout = LAYOUT
    takes_user_evidence = False  # it is the user's evidence

    @staticmethod
    def partial_requires(require: tuple[str, ...]) -> list[str]:
        """`partial_requires`, for check-config (which asks the registry's `USER_PATTERN`)."""
        return partial_requires(require)

    def evidence(self, save: Save) -> Evidence:
        pattern, files = save.pattern, save.files
        formats = [c for c in (sharded_weights(save.path, files), whole_files(save), whole_archives(save),
                               config_without_weights(save), *run_records(save)) if c is not None]
        if pattern is not None and pattern.evidence:
            checks, ranks = [_required(files, glob) for glob in pattern.require], None
            if pattern.ranks is not None:
                regex = re.compile(re.escape(pattern.ranks).replace(re.escape("{rank}"), r"(\d+)"))
                world = known_world(save.world_size, save.mp_world_size)
                rank_check, ranks = rank_files(files, regex, world, name=f"ranks ({pattern.ranks})")
                checks.append(rank_check)
            return Evidence(checks + formats, ranks)
        named = f"pattern {pattern.name!r} names" if pattern is not None else "it has"
        return Evidence([Check(EVIDENCE, PASSED, f"{named} {QUIET_ALONE}"), *formats])


FRAMEWORK = UserPattern()
