"""The model weights of a save, in the forms the Hugging Face libraries write them.

Positive evidence: a Trainer or accelerate save is complete only if its weights are there, and
whole. Without this a checkpoint copied in by a copier that died before the big file (small
files first, with the source's mtimes) passes every other check: trainer_state.json parsed,
every rank's rng state, quiet for hours; and the Trainer then refuses it ("Can't find a valid
checkpoint"). The weights' own integrity (a safetensors header's offsets, a torch zip's end
record) is checked with every other file; here: that they are there at all, and every shard an
index names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from ckptd.frameworks.base import MTIME_SLACK
from ckptd.model import Check, Entry, Verdict
from ckptd.volume import volread

WEIGHTS = "weights"
MAX_INDEX_BYTES = 64 * 1024 * 1024

# transformers' save_pretrained (modeling_utils.py, SAFE_WEIGHTS_NAME / WEIGHTS_NAME, the shards
# and their index when larger than max_shard_size), PEFT's save_pretrained of an adapter
# (ADAPTER_SAFE_WEIGHTS_NAME / ADAPTER_WEIGHTS_NAME); accelerate's save_state numbers the second
# model's `model_1.safetensors` (checkpointing.py save_accelerator_state: `.` -> `_<i>.`).
SINGLE = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
SAFETENSORS_INDEX = "model.safetensors.index.json"
INDEXES = (SAFETENSORS_INDEX, "pytorch_model.bin.index.json")
# FSDP through accelerate (utils/fsdp_utils.py save_fsdp_model), which the Trainer calls too:
# FULL_STATE_DICT `pytorch_model_fsdp[_<i>].bin`, LOCAL_STATE_DICT one `..._rank<r>.bin` per rank,
# SHARDED_STATE_DICT a DCP directory `pytorch_model_fsdp_<i>/` (its .metadata is demanded with
# every nested DCP directory's).
_FSDP = re.compile(r"pytorch_model_fsdp(?:_\d+)?(?:_rank\d+)?\.bin|pytorch_model_fsdp_\d+/\.metadata")
_NUMBERED = re.compile(r"(?:model|pytorch_model)_(\d+)\.(?:safetensors|bin)")


def index_shards(path: Path, files: Mapping[str, Entry], index: str) -> list[str] | str:
    """The shard files an index's `weight_map` names, or why they cannot be known."""
    entry = files[index]
    if entry.size > MAX_INDEX_BYTES:
        return f"{index}: {entry.size} bytes, too large to parse"
    try:
        with volread.open_file(path / index) as f:
            weight_map = json.loads(f.read(MAX_INDEX_BYTES + 1)).get("weight_map")
    except (OSError, ValueError, RecursionError, AttributeError) as exc:
        return f"{index} unreadable: {type(exc).__name__}: {exc}"
    if not isinstance(weight_map, dict) or not weight_map:
        return f"{index} has no weight_map"
    return sorted({str(v) for v in weight_map.values()})


def _present(files: Mapping[str, Entry], rel: str) -> bool:
    e = files.get(rel)
    return e is not None and e.kind == "f"


# Each form a save's weights may take: its check where the save holds weights in that form, else
# None. `weights_check` tries them in order; the first that finds weights decides.


def _indexed(path: Path, files: Mapping[str, Entry], tags: Iterable[str]) -> Check | None:
    """Sharded: an index, and every shard it names."""
    for index in INDEXES:
        if _present(files, index):
            shards = index_shards(path, files, index)
            if isinstance(shards, str):
                return Check(WEIGHTS, Verdict.FAILED, shards)
            missing = [s for s in shards if not _present(files, s)]
            if missing:
                n = len(shards)
                why = f"{missing[0]} missing ({n - len(missing)}/{n} shards named by {index})"
                return Check(WEIGHTS, Verdict.FAILED, why)
            return Check(WEIGHTS, Verdict.PASSED, f"{index} and its {len(shards)} shards")
    return None


def _single(path: Path, files: Mapping[str, Entry], tags: Iterable[str]) -> Check | None:
    """One file (a model's or an adapter's), and accelerate's numbered further models beside it."""
    found = next((w for w in SINGLE if _present(files, w)), None)
    if found is None:
        return None
    numbered = sorted(int(m[1]) for rel in files if (m := _NUMBERED.fullmatch(rel)) and _present(files, rel))
    # accelerate numbers each model after the first: model_2 without model_1 lost one
    gap = next((i for i in range(1, len(numbered) + 1) if i not in numbered), None)
    if numbered and gap is not None and gap < max(numbered):
        why = f"model {gap}'s weights missing beside model {max(numbered)}'s"
        return Check(WEIGHTS, Verdict.FAILED, why)
    more = f" (+{len(numbered)} more models)" if numbered else ""
    return Check(WEIGHTS, Verdict.PASSED, f"{found}{more}")


def _fsdp(path: Path, files: Mapping[str, Entry], tags: Iterable[str]) -> Check | None:
    """FSDP's, through accelerate: a full or per-rank state dict, or a DCP directory."""
    fsdp = sorted(rel for rel in files if _FSDP.fullmatch(rel) and _present(files, rel))
    if fsdp:
        return Check(WEIGHTS, Verdict.PASSED, f"FSDP's {fsdp[0].partition('/')[0]}")
    return None


def _deepspeed_tag(path: Path, files: Mapping[str, Entry], tags: Iterable[str]) -> Check | None:
    """The model states in one of DeepSpeed's tag directories `tags`."""
    for tag in tags:
        prefix = f"{tag}/" if tag else ""
        states = (rel for rel in files if rel.startswith(prefix) and rel.endswith("model_states.pt"))
        if any(_present(files, rel) for rel in states):
            return Check(WEIGHTS, Verdict.PASSED, f"in DeepSpeed's {tag or 'tag'} (model states)")
    return None


_FORMS = (_indexed, _single, _fsdp, _deepspeed_tag)


def weights_check(
    path: Path, files: Mapping[str, Entry], *, who: str, tags: Iterable[str] = ()
) -> Check:
    """Whether a save's weights are there, in any form `who` writes them: one file, sharded with an
    index naming every shard, an adapter, FSDP's, or a DeepSpeed tag directory in `tags` holding
    the model states (the Trainer under ZeRO-3 without gathering saves no other weights; the tag's
    own census is checked beside this). Failed when none is, naming what was looked for."""
    for form in _FORMS:
        check = form(path, files, tags)
        if check is not None:
            return check
    why = (
        f"no model weights ({', '.join(SINGLE[:2])}, an index and its shards, an adapter, FSDP's, "
        "DeepSpeed's): "
        f"{who} writes them first, so a save killed later has them; a copy in not finished?"
    )
    return Check(WEIGHTS, Verdict.FAILED, why)


WEIGHTS_ORDER = "weights order"
_WEIGHTS_FILE = re.compile(
    r"(?:model|pytorch_model|adapter_model)(?:_\d+|-\d+-of-\d+)?\.(?:safetensors|bin)"
    r"|(?:model\.safetensors|pytorch_model\.bin)\.index\.json"
)


def weights_order(files: Mapping[str, Entry], last: str, who: str, tags: Collection[str]) -> Check | None:
    """Failed when the weights were written after `last`, the file `who` writes last in a save
    (the Trainer's trainer_state.json, accelerate's random_states_0.pkl), in a save with no
    DeepSpeed tag: a re-save in place killed after its weights, beside the older save's optimizer
    and state (the Trainer's and accelerate's resume fail on it, or resume silently with mixed
    state). Under DeepSpeed nothing is said: zero_to_fp32.py, which the Trainer copies into the
    checkpoint, writes the weights there later, and so does ckptd's own consolidation. None when
    there is nothing to say (no `last`, or the weights in order)."""
    ts = files.get(last)
    if tags or ts is None or ts.kind != "f":
        return None
    gap, rel = max(
        (((e.mtime_ns - ts.mtime_ns) / 1e9, rel) for rel, e in files.items()
         if "/" not in rel and e.kind == "f" and _WEIGHTS_FILE.fullmatch(rel)),
        default=(0.0, ""),
    )
    if gap <= MTIME_SLACK:
        return None
    why = (f"files from two saves: {last} is {gap:.0f}s older than {rel}, which {who} writes before it "
           "(and nothing writes later without DeepSpeed); a re-save in place not finished?")
    return Check(WEIGHTS_ORDER, Verdict.FAILED, why)
