"""`save_pretrained` in a custom training loop, for a user pattern (`step_{step}`), killed between
two shards and before its index; and `from_pretrained`'s verdict on each save. For
tests/completeness/test_pattern_formats.py.

``python -m tests.support.fwpretrained OUT NAME[:KILL] ...``: imports transformers once, then per
NAME forks a child that builds a tiny GPT-2 from a config (CPU, offline) and saves it with
transformers' own `save_pretrained(OUT/NAME, max_shard_size="8KB")`: config.json and
generation_config.json, then shards `model-0000i-of-00004.safetensors` one by one, then
`model.safetensors.index.json` (modeling_utils.py save_pretrained). KILL=k SIGKILLs the child as
transformers goes to write shard k (shards 1..k-1 whole on disk); KILL=index as it goes to open
the index (every shard there, no index). Then `GPT2LMHeadModel.from_pretrained` on each, in this process.
Prints one JSON line: {NAME: {"exit": the child's status, "load": "loaded" or "failed: <error>"}}.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from tests.support import refuse_in_light_test

MAX_SHARD = "8KB"


def _save(out: str, kill: str | None) -> None:
    import torch
    import transformers.modeling_utils as mu
    from transformers import GPT2Config, GPT2LMHeadModel

    written: list[str] = []
    real_save = mu.safe_save_file

    def save_file(tensors, filename, *a, **k):
        if kill is not None and kill != "index" and len(written) + 1 == int(kill):
            os.kill(os.getpid(), signal.SIGKILL)  # shards 1..k-1 are on disk, the index is not
        real_save(tensors, filename, *a, **k)
        written.append(filename)

    def open_file(file, *a, **k):  # modeling_utils' own `open`, which writes the index
        if kill == "index" and str(file).endswith(".index.json"):
            os.kill(os.getpid(), signal.SIGKILL)  # every shard on disk, not the index
        return open(file, *a, **k)

    mu.safe_save_file, mu.open = save_file, open_file
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    model.save_pretrained(out, max_shard_size=MAX_SHARD)


def main(out: str, specs: list[str]) -> int:
    import torch
    from transformers import GPT2LMHeadModel

    torch.set_num_threads(1)
    result = {}
    for spec in specs:
        name, _, kill = spec.partition(":")
        pid = os.fork()
        if pid == 0:
            try:
                _save(os.path.join(out, name), kill or None)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        result[name] = {"exit": -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)}
    for name in result:
        try:
            GPT2LMHeadModel.from_pretrained(os.path.join(out, name))
            result[name]["load"] = "loaded"
        except Exception as exc:  # from_pretrained's own verdict
            result[name]["load"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    refuse_in_light_test("transformers' save_pretrained (tests/support/fwpretrained.py)")
    sys.exit(main(sys.argv[1], sys.argv[2:]))
