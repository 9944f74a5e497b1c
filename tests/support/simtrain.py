"""A simulated multi-rank trainer that saves DeepSpeed-shaped checkpoints in place.

For the daemon tests: rank 0 writes its model states, `latest` and
`trainer_state.json` first; every other rank writes its optimizer shard in
chunks, staggered; one slow rank (as with `offload_optimizer: cpu`) finishes
seconds later. Every writer checks, after each chunk, that its checkpoint
directory is still the one it created: a checkpoint renamed or deleted under
a writer is reported as a violation. The pauses here simulate slow ranks and
training time; nothing is synchronised by them.

    python -m tests.support.simtrain RUN_DIR --world 4 --steps 10 20 30 --slow-rank 3 --slow-delay 2

Prints one JSON document: {"saves": [...], "violations": [...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import threading
import time
import zipfile
from pathlib import Path


def write_shard(path: Path, chunks: int, chunk_size: int, pause: float, check) -> None:
    """A torch.save-like zip written chunk by chunk: not a valid zip until closed."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z, z.open("archive/data.pkl", "w") as f:
        for _ in range(chunks):
            f.write(os.urandom(chunk_size))
            check()
            if pause:
                time.sleep(pause)
    check()


def save(run: Path, step: int, a: argparse.Namespace, losses: dict[int, float], violations: list[str]) -> None:
    ckpt = run / f"checkpoint-{step}"
    gs = ckpt / f"global_step{step}"
    gs.mkdir(parents=True)
    ino = os.stat(ckpt).st_ino

    def check(who: str) -> None:
        try:
            same = os.stat(ckpt).st_ino == ino
        except FileNotFoundError:
            same = False
        if not same:
            violations.append(f"{ckpt.name} vanished while {who} was writing")

    # rank 0: model states, then `latest` and trainer_state.json early (before the other ranks finish)
    states = {"dp_world_size": a.world, "mp_world_size": 1, "ds_config": {"zero_optimization": {"stage": 2}}}
    with zipfile.ZipFile(gs / "mp_rank_00_model_states.pt", "w") as z:
        z.writestr("mp_rank_00_model_states/data.pkl", pickle.dumps(states, protocol=2))
    check("rank 0")
    (ckpt / "latest").write_text(f"global_step{step}")
    best = min(losses, key=lambda s: (losses[s], s)) if losses else None
    history = [{"step": s, "eval_loss": v} for s, v in sorted(losses.items()) if s <= step]
    state = {"global_step": step, "log_history": history,
             "best_model_checkpoint": f"{run}/checkpoint-{best}" if best is not None and best <= step else None}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))

    def rank(r: int) -> None:
        if r == a.slow_rank:
            time.sleep(a.slow_delay)
        else:
            time.sleep(r * a.gap)
        name = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        write_shard(gs / name, a.chunks, a.chunk_size, a.chunk_pause, lambda: check(f"rank {r}"))
        (ckpt / f"rng_state_{r}.pth").write_bytes(_tiny_zip())
        check(f"rank {r}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(a.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _tiny_zip() -> bytes:
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"rng")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("run", type=Path)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, nargs="+", default=[10, 20, 30])
    p.add_argument("--losses", type=float, nargs="*", help="eval_loss per step (default: the first is best)")
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--slow-delay", type=float, default=2.0)
    p.add_argument("--gap", type=float, default=0.05, help="stagger between ranks")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-size", type=int, default=64 * 1024)
    p.add_argument("--chunk-pause", type=float, default=0.02)
    p.add_argument("--train-time", type=float, default=0.5, help="time between saves")
    a = p.parse_args(argv)
    # default: the oldest checkpoint is the best, the case in-process rotation got wrong
    losses_list = a.losses or [0.1] + [0.9 - 0.01 * i for i in range(1, len(a.steps))]
    violations: list[str] = []
    saves = []
    a.run.mkdir(parents=True, exist_ok=True)
    for i, step in enumerate(a.steps):
        losses = dict(zip(a.steps[: i + 1], losses_list[: i + 1], strict=True))
        t0 = time.monotonic()
        save(a.run, step, a, losses, violations)
        saves.append({"step": step, "seconds": round(time.monotonic() - t0, 3), "done_at": time.time()})
        if i + 1 < len(a.steps):
            time.sleep(a.train_time)
    print(json.dumps({"saves": saves, "violations": violations}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
