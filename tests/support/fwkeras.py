"""Real Keras 3 ModelCheckpoint saves, one of them killed mid-save, for tests/completeness/test_keras.py.

``python -m tests.support.fwkeras OUT RUN KIND [KILL_EPOCH | check]``, KIND ``keras`` or ``weights``: a tiny model
fits 3 epochs on the CPU (torch backend) with ``keras.callbacks.ModelCheckpoint`` writing
``OUT/RUN/model-epoch={epoch:02d}-val_loss={val_loss:.3f}.keras`` (``model.save``: a zip written in
place, saving_lib.save_model) or ``...weights.h5`` (``save_weights_only=True``: HDF5 written in
place). KIND ``docs-keras``, ``docs-metric``, ``docs-weights``: the templates Keras's own docs use
(``TEMPLATES``), ``docs-weights-long`` the last over 12 epochs; ``docs-weights`` with ``BackupAndRestore(OUT/RUN/backup, delete_checkpoint=False)``
beside it. With KILL_EPOCH, the process SIGKILLs itself inside that epoch's save, as the weights store
closes (saving_lib.H5IOStore.close): what a job killed mid-save leaves. Each whole save is loaded
back with keras's own loader; prints one JSON line {file: "loads" | error}.

``python -m tests.support.fwkeras OUT batch KILL_EPOCH RUN:KIND ...``: the same runs from one interpreter, so
keras and torch are imported once (the import is nearly all of a run's CPU time): each run fits in a forked
child, which SIGKILLs itself in KILL_EPOCH's save as above, then this process loads every file back.
Prints one JSON line {"killed": {RUN: signal the child died of}, "truth": {"RUN/file": "loads" | error}}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from tests.support import refuse_in_light_test

os.environ.setdefault("KERAS_BACKEND", "torch")

# KIND -> ModelCheckpoint's filepath template
TEMPLATES = {
    "keras": "model-epoch={epoch:02d}-val_loss={val_loss:.3f}.keras",
    "weights": "model-epoch={epoch:02d}-val_loss={val_loss:.3f}.weights.h5",
    "docs-keras": "model.{epoch:02d}-{val_loss:.2f}.keras",  # keras.callbacks.ModelCheckpoint's docstring
    "docs-metric": "epoch{epoch:02d}-val_loss{val_loss:.3f}.keras",
    "docs-weights": "w-{epoch:02d}.weights.h5",
    "docs-weights-long": "w-{epoch:02d}.weights.h5",  # 12 epochs: from epoch 10 on the padding shows no more
}
EPOCHS = {"docs-weights-long": 12}  # else 3


def _whole_model(kind: str) -> bool:
    return TEMPLATES[kind].endswith(".keras")


def main(out: str, run: str, kind: str, kill_epoch: int | None) -> int:
    import keras
    import numpy as np
    from keras.src.saving import saving_lib

    keras.utils.set_random_seed(3)
    d = Path(out) / run
    d.mkdir(parents=True, exist_ok=True)
    template = str(d / TEMPLATES[kind])

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        return model

    model = build()
    state = {"epoch": 0}
    close = saving_lib.H5IOStore.close

    def killing_close(self):
        if state["epoch"] == kill_epoch:
            os.kill(os.getpid(), signal.SIGKILL)  # inside the save: the weights not closed
        return close(self)

    saving_lib.H5IOStore.close = killing_close

    class Epoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            state["epoch"] = epoch + 1  # ModelCheckpoint formats {epoch} as epoch + 1

    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    checkpoint = keras.callbacks.ModelCheckpoint(template, save_weights_only=not _whole_model(kind))
    callbacks = [Epoch(), checkpoint]
    if kind == "docs-weights":
        callbacks.append(keras.callbacks.BackupAndRestore(str(d / "backup"), delete_checkpoint=False))
    model.fit(x, y, validation_data=(x, y), epochs=EPOCHS.get(kind, 3), batch_size=8, verbose=0, callbacks=callbacks)
    saving_lib.H5IOStore.close = close
    truth = {}
    for p in sorted(d.iterdir()):
        if p.is_dir():
            continue  # BackupAndRestore's
        try:
            if _whole_model(kind):
                keras.saving.load_model(p)
            else:
                build().load_weights(p)
            truth[p.name] = "loads"
        except Exception as exc:  # the framework's own verdict
            truth[p.name] = f"{type(exc).__name__}: {exc}"[:200]
    print(json.dumps(truth))
    return 0


def _verdicts(out: str, run: str, kind: str) -> dict[str, str]:
    """Load every file of a run back with Keras's own loader: {file: "loads" | error}."""
    import keras

    truth = {}
    for p in sorted((Path(out) / run).iterdir()):
        if p.is_dir():
            continue  # BackupAndRestore's
        try:
            if _whole_model(kind):
                keras.saving.load_model(p)
            else:
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
                model.load_weights(p)
            truth[p.name] = "loads"
        except Exception as exc:  # the framework's own verdict
            truth[p.name] = f"{type(exc).__name__}: {exc}"[:200]
    return truth


def check(out: str, run: str, kind: str) -> int:
    print(json.dumps(_verdicts(out, run, kind)))
    return 0


def batch(out: str, kill_epoch: int, runs: list[str]) -> int:
    """Each RUN:KIND fitted in its own forked child (killed mid-save), then all loaded back here."""
    import keras  # noqa: F401  imported before the forks: each child inherits it

    killed = {}
    for spec in runs:
        run, kind = spec.split(":")
        pid = os.fork()
        if pid == 0:  # the child: a whole run, ending in its own SIGKILL; never back into this loop
            try:
                os._exit(main(out, run, kind, kill_epoch))
            finally:
                os._exit(70)
        _, status = os.waitpid(pid, 0)
        killed[run] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
    truth = {}
    for spec in runs:
        run, kind = spec.split(":")
        truth.update({f"{run}/{k}": v for k, v in _verdicts(out, run, kind).items()})
    print(json.dumps({"killed": killed, "truth": truth}))
    return 0


if __name__ == "__main__":
    refuse_in_light_test("Keras (tests/support/fwkeras.py)")
    if sys.argv[2:3] == ["batch"]:
        sys.exit(batch(sys.argv[1], int(sys.argv[3]), sys.argv[4:]))
    if sys.argv[4:] == ["check"]:
        sys.exit(check(sys.argv[1], sys.argv[2], sys.argv[3]))
    kill = int(sys.argv[4]) if len(sys.argv) > 4 else None
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], kill))
