"""The Hugging Face Trainer: `checkpoint-<step>/`.

transformers' Trainer._save_checkpoint writes, in order: the weights (save_model: `model.safetensors`,
sharded with an index, an adapter, FSDP's; under DeepSpeed ZeRO-3 without gathering, only the tag),
`training_args.bin`; DeepSpeed's `global_step<N>/` (the Trainer's DeepSpeed composition: DeepSpeed's own
census on that tag), `optimizer.pt`, `scheduler.pt`, `scaler.pt`; each process its `rng_state_<rank>.pth`
(no barrier); then process 0's `trainer_state.json`, last. `save_only_model` leaves out everything but
the weights and trainer_state.json.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from ckptd.frameworks import copyin, deepspeed, hfweights
from ckptd.frameworks.base import (
    FAILED,
    MAX_TRAINER_STATE_BYTES,
    PASSED,
    UNKNOWN,
    Evidence,
    Framework,
    MemoryKind,
    Remembered,
    Save,
    files_whole,
    known_world,
    rank_files,
    read_now,
    read_pointer,
)
from ckptd.frameworks.deepspeed import global_step_dirs
from ckptd.model import Candidate, Check, Entry, TrainerState, as_metric
from ckptd.volume import volread

LAYOUT = "hf"
TRAINER_STATE = "trainer_state.json"
_NAME = re.compile(r"checkpoint-(\d+)")  # Trainer._save_checkpoint: f"{PREFIX_CHECKPOINT_DIR}-{global_step}"
# Weights a checkpoint may hold already (Trainer, PEFT), best first: what a slim keeps, and then
# nothing needs consolidating; and save_model's shards of them.
WEIGHTS_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
# What loading the weights reads (transformers' from_pretrained: the model's config and the shard
# index beside the weights; AutoTokenizer.from_pretrained: the tokenizer files, by the names
# PreTrainedTokenizerBase and the common tokenizers' VOCAB_FILES_NAMES give them; PEFT's
# PeftModel.from_pretrained: adapter_config.json), and the weights themselves.
LOAD_NEEDS = (
    "config.json", "generation_config.json", "adapter_config.json", "preprocessor_config.json",
    *WEIGHTS_FILES, "model-00001-of-00002.safetensors", "pytorch_model-00001-of-00002.bin",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json",
)
_SHARDED_WEIGHTS = re.compile(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)")

_RNG = re.compile(r"rng_state_(\d+)\.pth")


# Written by the Trainer before trainer_state.json, in the same save (transformers 5.x
# Trainer._save_checkpoint: save_model (training_args.bin), _save_optimizer_and_scheduler (DeepSpeed's
# save_checkpoint, which ends in a barrier after every rank's shard and `latest`; optimizer.pt,
# scheduler.pt), _save_scaler, _save_rng_state (process 0's, the process that then writes
# trainer_state.json), then trainer_state.json. Not the model weights: zero_to_fp32.py, which the
# Trainer copies into the checkpoint, is run there by hand later and writes them.
_BEFORE_TRAINER_STATE = frozenset({
    "latest", "optimizer.pt", "scheduler.pt", "scaler.pt", "training_args.bin",
    "rng_state.pth", "rng_state_0.pth",
})


_GLOBAL_STEP_FILE = re.compile(r"global_step\d+/.+")


def _before_trainer_state(rel: str) -> bool:
    return rel in _BEFORE_TRAINER_STATE or bool(_GLOBAL_STEP_FILE.fullmatch(rel))


def _rng_states(files: dict[str, Entry], world: int | None) -> tuple[Check, int | None]:
    """One rng_state_<rank>.pth per process (the Trainer): each rank writes its own, with no barrier.

    Returns the check and, when no world size was known, how many ranks were counted (for
    `against_siblings`: ranks 0..6 are contiguous, and still one short of a run of 8).
    """
    if not any(_RNG.fullmatch(rel) for rel in files if "/" not in rel):
        if "rng_state.pth" in files:
            return Check("rng states", PASSED, "rng_state.pth (one process)"), None
        return Check("rng states", PASSED, "none saved"), None
    return rank_files(files, _RNG, world, name="rng states")


def _deepspeed_latest(path: Path, files: Mapping[str, Entry], remembered: Remembered = read_now) -> Check:
    """DeepSpeed's `latest` inside a Trainer checkpoint holding `global_step*/`: the Trainer resumes
    through transformers integrations/deepspeed.py `deepspeed_load_checkpoint`, which calls
    `engine.load_checkpoint(checkpoint_path)` with tag=None; DeepSpeed's runtime/engine.py
    `load_checkpoint` then reads the tag from `latest` (`latest_universal` for a universal
    checkpoint), stripped, and without it returns None, which the Trainer raises on. So `latest`
    must be a file naming a tag directory that is there. Required, never trusted: rank 0 writes it
    before the other ranks finish, so the shard census still decides whether the save is whole."""
    name = "deepspeed latest"
    pointer = next((p for p in ("latest", "latest_universal") if p in files), "latest")
    if pointer not in files:
        return Check(name, FAILED, "latest missing: the Trainer resumes through load_checkpoint(tag=None)")
    try:
        tag = str(remembered(pointer, lambda: read_pointer(path / pointer)))
    except OSError as exc:
        return Check(name, FAILED, f"{pointer} unreadable: {type(exc).__name__}: {exc}")
    if not tag:
        return Check(name, FAILED, f"{pointer} is empty: load_checkpoint would look for tag ''")
    if tag.startswith("/") or ".." in tag.split("/"):
        return Check(name, UNKNOWN, f"{pointer} names {tag[:200]!r}, outside the checkpoint")
    e = files.get(tag.rstrip("/"))
    if e is None or e.kind != "d":
        return Check(name, FAILED, f"{pointer} names {tag[:200]!r}, which is not a directory here")
    return Check(name, PASSED, f"{pointer} names {tag}, present")


# What Trainer._save_checkpoint writes unless `save_only_model` (transformers trainer.py): then
# _save_optimizer_and_scheduler writes optimizer.pt (DeepSpeed: its tag instead; FSDP:
# save_fsdp_optimizer's optimizer*.bin or optimizer_0/) and scheduler.pt (not under DeepSpeed with
# its own scheduler), _save_scaler scaler.pt when there is a scaler, _save_rng_state always its
# rng_state.pth (rng_state_<rank>.pth with several processes).
_STATE_KINDS = re.compile(r"optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(?:_\d+)?\.pth")
_FSDP_OPTIMIZER = re.compile(r"optimizer(?:_\d+)?(?:\.bin|/.*)?")


def _kind(rel: str) -> str | None:
    if "/" not in rel and _STATE_KINDS.fullmatch(rel):
        return "rng_state.pth" if rel.startswith("rng_state") else rel
    return None


def _state_files(
    files: Mapping[str, Entry], tags: list[str], removed: frozenset[str] = frozenset()
) -> tuple[Check, frozenset[str]]:
    """The optimizer, scheduler and RNG files a save that is not `save_only_model` writes: one of
    them there says the save was not model-only, and then the others must be there too. The kinds
    present are returned for the run's census (a checkpoint missing all of them looks model-only)."""
    name = "trainer state files"
    kinds = frozenset(k for rel, e in files.items() if e.kind == "f" and (k := _kind(rel)))
    kinds |= {k for rel in removed if (k := _kind(rel))}  # what a slim removed on purpose (its marker)
    if not kinds and not tags:
        return Check(name, PASSED, "none (save_only_model; the run's other checkpoints are asked too)"), kinds
    required = ["rng_state.pth"]
    fsdp = any(_FSDP_OPTIMIZER.fullmatch(rel) and rel != "optimizer.pt" for rel in files)
    if not tags:
        required.append("scheduler.pt")
        if not fsdp:
            required.append("optimizer.pt")
    missing = [k for k in sorted(required) if k not in kinds]
    if missing:
        shown = ", ".join("rng_state[_<rank>].pth" if k == "rng_state.pth" else k for k in missing)
        beside = ", ".join(sorted(kinds | set(tags)))
        why = f"{shown} missing: the Trainer writes it with {beside} unless save_only_model"
        return Check(name, FAILED, why), kinds
    return Check(name, PASSED, f"{', '.join(sorted(kinds))} (not save_only_model)"), kinds


# The JSON files save_model writes beside the weights (config.json, generation_config.json, the
# tokenizer's, adapter_config.json): transformers' from_pretrained, which a resume runs
# (Trainer._load_from_checkpoint: PretrainedConfig.from_json_file), raises on one that does not
# parse. A small one is parsed; a large one (a tokenizer.json) must begin and end as JSON does.
_JSON_PARSED_BYTES = 1024 * 1024


def json_problem(path: Path, size: int) -> str | None:
    if size == 0:
        return "is empty"
    try:
        if size <= _JSON_PARSED_BYTES:
            json.loads(volread.read_bytes(path, _JSON_PARSED_BYTES + 1))
            return None
        with volread.open_file(path) as f:
            head = f.read(4096).lstrip()[:1]
            f.seek(max(0, size - 4096))
            tail = f.read(4096).rstrip()[-1:]
    except (ValueError, RecursionError) as exc:
        return f"does not parse: {type(exc).__name__}: {str(exc)[:120]}"
    if (head, tail) not in ((b"{", b"}"), (b"[", b"]")):
        return "does not end as it begins (cut short?)"
    return None


def _json_files(path: Path, files: Mapping[str, Entry], remembered: Remembered = read_now) -> Check:
    """Every JSON file the save wrote at its top parses (trainer_state.json has its own check)."""
    name = "trainer json files"
    rels = sorted(rel for rel, e in files.items() if e.kind == "f" and "/" not in rel
                  and rel.endswith(".json") and rel != TRAINER_STATE)
    failed = files_whole(name, path, files, rels, json_problem, "from_pretrained raises on it", remembered)
    return failed or Check(name, PASSED, f"{len(rels)} JSON files parse" if rels else "no other JSON files")


class Trainer(Framework):
    layout = LAYOUT
    named_alone = True
    names_first = True
    last_written = (TRAINER_STATE, "the Trainer", _before_trainer_state)
    slim_weights = WEIGHTS_FILES
    load_needs = LOAD_NEEDS
    read_whole = frozenset({"latest", "latest_universal"})  # _deepspeed_latest reads the tag it names

    def recognise_name(self, name: str, is_dir: bool) -> Candidate | None:
        m = _NAME.fullmatch(name) if is_dir else None
        return Candidate(name, int(m[1]), LAYOUT, True) if m else None

    def evidence(self, save: Save) -> Evidence:
        files = save.files
        checks = []
        ts_check, trainer_state = remembered_trainer_state(save)
        checks.append(ts_check)
        census = [deepspeed.census(save, d) for d in global_step_dirs(files)]
        checks.extend(check for check, _ in census)
        if census:
            checks.append(_deepspeed_latest(save.path, files, save.remembered_file))
        worlds = [w.dp * w.mp for _, w in census if w is not None]
        if not worlds:  # a DDP job's world size, from the config
            worlds = [w] if (w := known_world(save.world_size, save.mp_world_size)) else []
        rng_check, ranks = _rng_states(files, worlds[0] if worlds else None)
        checks.append(rng_check)
        checks.append(copyin.copy_leftovers(files))
        tags = global_step_dirs(files)
        checks.append(hfweights.weights_check(save.path, files, who="the Trainer", tags=tags))
        if (order := hfweights.weights_order(files, TRAINER_STATE, "the Trainer", tags)) is not None:
            checks.append(order)
        state_check, kinds = _state_files(files, tags, save.removed)
        checks.append(state_check)
        checks.append(_json_files(save.path, files, save.remembered_file))
        return Evidence(checks, ranks, trainer_state, kinds)

    def tags(self, files: Mapping[str, Entry]) -> list[str]:
        return global_step_dirs(files)

    def slim_keeps(self, name: str) -> bool:
        return name in WEIGHTS_FILES or bool(_SHARDED_WEIGHTS.fullmatch(name)) or name == TRAINER_STATE

    def consolidation_source(self, name: str, files: Mapping[str, Entry]) -> tuple[str | None, str | None]:
        """Its one DeepSpeed tag (the Trainer under DeepSpeed saves `global_step<N>/` inside it)."""
        tags = global_step_dirs(files)
        if len(tags) != 1:
            return None, f"{len(tags) or 'no'} global_step directories to consolidate from"
        tag = tags[0]
        names = {rel[len(tag) + 1 :] for rel in files if rel.startswith(f"{tag}/")}
        problem = deepspeed.consolidation_problem(tag, names)
        return (None, problem) if problem else (tag, None)

    def consolidation_paths(self, name: str, source: str, files: Collection[str]) -> tuple[str, str, str]:
        inside = f"{source}/"  # zero_to_fp32 takes the checkpoint as the save_dir holding its tag
        return name, source, f"{name}/{inside}{deepspeed.model_states_file(files, inside)}"

    def consolidation_reads(self, name: str) -> bool:
        return deepspeed.zero_to_fp32_reads(name)

    def save_file(self, rel: str) -> bool:
        return rel == TRAINER_STATE or _before_trainer_state(rel) or bool(_RNG.fullmatch(rel))

    def written_before(self, rel: str) -> Callable[[str], bool] | None:
        return _before_trainer_state if rel == TRAINER_STATE else None

    def step_mismatch(self, name: str, step: int, names: list[str], ts: TrainerState | None) -> list[str]:
        """`checkpoint-3500` holding `global_step2000/` (or a trainer_state.json at another global_step)
        was copied or renamed by hand: the Trainer names the directory from the step it saves."""
        out = []
        tags = sorted(n for n in names if re.fullmatch(r"global_step\d+", n))
        if tags and f"global_step{step}" not in tags:
            out.append(f"{name} holds {', '.join(tags)}, not global_step{step}: renamed or copied?")
        if ts is not None and ts.global_step is not None and ts.global_step != step:
            out.append(f"{name}'s {TRAINER_STATE} says global_step={ts.global_step}: renamed or copied?")
        return out


FRAMEWORK = Trainer()


# --- trainer_state.json ------------------------------------------------------------------


def remembered_trainer_state(save: Save) -> tuple[Check, TrainerState | None]:
    """`_trainer_state`, parsed again only when the file changed: an in-flight checkpoint is looked
    at every poll, and a long run's log history takes tens of milliseconds to parse."""
    path, files = save.path, save.files
    entry = files.get(TRAINER_STATE)
    if entry is None or entry.kind != "f":
        return _trainer_state(path, files)

    def read() -> tuple[Check, TrainerState | None]:
        check, ts = _trainer_state(path, files)
        return check, (save.share_history(ts, str(path.parent)) if ts is not None else None)

    try:
        return save.remembered(MemoryKind.TRAINER_STATE, entry, read)  # type: ignore[return-value]
    except OSError as exc:  # not remembered: read again next time
        return Check(TRAINER_STATE, FAILED, f"unreadable: {type(exc).__name__}: {exc}"), None


def _trainer_state(path: Path, files: Mapping[str, Entry]) -> tuple[Check, TrainerState | None]:
    entry = files.get(TRAINER_STATE)
    if entry is None or entry.kind != "f":
        return Check(TRAINER_STATE, FAILED, "missing (the Trainer writes it last)"), None
    if entry.size > MAX_TRAINER_STATE_BYTES:
        return Check(TRAINER_STATE, FAILED, f"{entry.size} bytes: larger than this tool will parse"), None
    with volread.open_file(path / TRAINER_STATE) as f:  # an OSError is not a verdict: the caller's to handle
        raw = volread.read_upto(f, MAX_TRAINER_STATE_BYTES + 1)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return Check(TRAINER_STATE, FAILED, f"unreadable: {type(exc).__name__}: {exc}"), None
    if not isinstance(data, dict):
        return Check(TRAINER_STATE, FAILED, "not a JSON object"), None
    ts = parse_trainer_state(data)
    return Check(TRAINER_STATE, PASSED, f"parsed (global_step={ts.global_step})"), ts


def parse_trainer_state(data: dict) -> TrainerState:
    """The parts of a trainer_state.json retention uses; anything malformed is ignored."""
    history: dict[int, dict[str, object]] = {}
    log = data.get("log_history")
    for item in log if isinstance(log, list) else ():
        if (
            isinstance(item, dict)
            and isinstance(item.get("step"), int)
            and not isinstance(item["step"], bool)
        ):
            history.setdefault(item["step"], {}).update(item)
    best = data.get("best_model_checkpoint")
    best_name = os.path.basename(os.path.normpath(best)) if isinstance(best, str) and best else None
    best_metric = data.get("best_metric")
    step = data.get("global_step")
    return TrainerState(
        global_step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        best_model_checkpoint=best_name,
        best_metric=as_metric(best_metric)  # type: ignore[arg-type]
        if isinstance(best_metric, int | float) and not isinstance(best_metric, bool)
        else None,
        history=history,
    )
