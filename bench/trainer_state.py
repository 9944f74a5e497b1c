"""Looking at an in-flight Trainer checkpoint again: its trainer_state.json parsed anew vs remembered.

`python -m bench.trainer_state`: one checkpoint whose trainer_state.json holds a long run's log
history (40k entries, ~3.6 MB), inspected as a poll does. The baseline, in the same run, is a
fresh `Inspector` each time (the JSON parsed on every look, as before the parse was remembered);
ckptd's own is one `Inspector` looking again at the unchanged file. Medians of 7, and the ratio.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from ckptd.cli.demo_volume import age, hf_deepspeed_checkpoint
from ckptd.discover import layouts
from ckptd.judge.evidence import Inspector, RunContext

ENTRIES = 40_000
REPS = 7


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ck = hf_deepspeed_checkpoint(root / "run", 10, world=2)
        history = [{"step": s, "loss": 1.0 / (s + 1), "learning_rate": 1e-4, "epoch": s / 1000}
                   for s in range(ENTRIES)]
        (ck / "trainer_state.json").write_text(json.dumps({"global_step": 10, "log_history": history}))
        age(ck, time.time() - 3600)
        cand = layouts.recognise_by_name(ck.name, True)
        ctx = RunContext(root / "run", frozenset(os.listdir(root / "run")))

        def look(inspector: Inspector) -> float:
            t0 = time.perf_counter()
            inspector.inspect(root, "run", ctx, cand, now=time.time())
            return time.perf_counter() - t0

        parsed = statistics.median(look(Inspector(quiet_period=60)) for _ in range(REPS))
        again = Inspector(quiet_period=60)
        look(again)
        remembered = statistics.median(look(again) for _ in range(REPS))
        size = (ck / "trainer_state.json").stat().st_size
    print(f"| look at an in-flight checkpoint ({ENTRIES:,} log entries, {size / 1e6:.1f} MB) | median |")
    print("|---|---|")
    print(f"| parsed on every look (baseline) | {parsed * 1e3:.1f} ms |")
    print(f"| remembered while unchanged (ckptd) | {remembered * 1e3:.2f} ms |")
    print(f"| ratio | {parsed / remembered:.0f}× cheaper |")


if __name__ == "__main__":
    main()
