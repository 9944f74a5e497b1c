"""A training script as the README's resume line runs it: `python train.py --resume_from_checkpoint
"$(ckptd latest out/)"`, for tests/discovery/test_resume_restart.py.

``python -m tests.support.fwrestart OUT N_EMBD SAVE_STEPS MAX_STEPS [--resume_from_checkpoint PATH]``:
fwresave's tiny GPT-2 Trainer (CPU, one process, offline) trained into OUT up to MAX_STEPS; the
argument is handed to ``Trainer.train(resume_from_checkpoint=...)`` as the HF examples hand theirs
(an empty string included: the Trainer then fails with "Can't find a valid checkpoint").
Prints one JSON line: the step the Trainer started from and the step it ended at.
"""

from __future__ import annotations

import argparse
import json
import sys

from tests.support import refuse_in_light_test
from tests.support.fwresave import _trainer


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("n_embd", type=int)
    p.add_argument("save_steps", type=int)
    p.add_argument("max_steps", type=int)
    p.add_argument("--resume_from_checkpoint", default=None)
    args = p.parse_args(argv)
    from transformers import TrainerCallback

    class CountSteps(TrainerCallback):
        steps = 0

        def on_step_end(self, *a, **k):
            CountSteps.steps += 1

    trainer = _trainer(args.out, args.n_embd, args.save_steps, args.max_steps)
    trainer.add_callback(CountSteps())
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    end = trainer.state.global_step
    print(json.dumps({"started_at": end - CountSteps.steps, "ended_at": end}))
    return 0


if __name__ == "__main__":
    refuse_in_light_test("an HF Trainer job (tests/support/fwrestart.py)")
    sys.exit(main(sys.argv[1:]))
