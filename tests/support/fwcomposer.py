"""Real MosaicML Composer CheckpointSaver saves, one of them killed mid-write, for
tests/completeness/test_composer.py.

``python -m tests.support.fwcomposer OUT RUN [KILL_EPOCH]``: a tiny classifier trains 3 epochs (4 batches
each) on the CPU with Composer's Trainer, whose CheckpointSaver writes ``OUT/RUN/ep{epoch}-ba{batch}-rank0.pt``
at the end of every epoch (composer/utils/checkpoint.py `_write_checkpoint_file`: `open(filename, 'wb')` and
`torch.save` into it, in place) and repoints the ``latest-rank0.pt`` symlink after each. With KILL_EPOCH the
process SIGKILLs itself inside that epoch's `torch.save`, once 8 KiB have reached the file: what a job killed
mid-save leaves. ``python -m tests.support.fwcomposer OUT RUN check`` loads every ``.pt`` back with Composer's
own loader (a Trainer given ``load_path``) and resumes the run as ``autoresume=True`` does (through
``latest-rank0.pt``); prints one JSON line {file: "loads at batch N" | error, "autoresume": ...}.

torchvision: Composer imports it at import time (composer/utils/misc.py, loggers/cometml_logger.py) but no
checkpoint code uses it. The package index has only CUDA builds of the torchvision that matches torch 2.13,
which cannot load beside the CPU torch here; where `import torchvision` fails, `_torchvision_absent` puts an
empty module in its place whose every name raises when used (the only stand-in here, and not on the save path).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from tests.support import refuse_in_light_test

KILL_AFTER = 8 * 1024  # bytes of the killed save (about 24 KiB whole) that reach the file before the SIGKILL


def _torchvision_absent() -> None:
    """Stand in for a torchvision that cannot be imported (see the module's docstring)."""
    import importlib.machinery

    try:
        import torchvision  # noqa: F401
        return
    except Exception:  # a CUDA build beside a CPU torch raises RuntimeError, not ImportError
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    import importlib.abc

    import torchmetrics.functional  # noqa: F401  (decides torchvision is absent before the stand-in exists)

    def missing(attr: str) -> type:
        def refuse(*args: object, **kwargs: object) -> None:
            raise RuntimeError(f"torchvision.{attr} is not installed here (tests/support/fwcomposer.py)")
        return type(attr, (), {"__init__": refuse})

    class Absent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        """Every `torchvision[.x]` an empty package whose every name is a class that raises when used."""

        def find_spec(self, name, path=None, target=None):
            if name != "torchvision" and not name.startswith("torchvision."):
                return None
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            def getattr_(attr: str) -> type:
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return missing(attr)
            module.__getattr__ = getattr_
            module.__path__ = []

    sys.meta_path.insert(0, Absent())


def _parts():
    _torchvision_absent()
    import torch
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x = torch.randn(32, 4)
    data = DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=8)

    def model():
        torch.manual_seed(0)
        # wide enough that one save is a few hundred KiB: the kill lands inside torch.save
        net = torch.nn.Sequential(torch.nn.Linear(4, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
        return ComposerClassifier(net, num_classes=2)

    def trainer(**kw):
        return Trainer(model=model(), train_dataloader=data, max_duration="3ep", device="cpu",
                       progress_bar=False, log_to_console=False, loggers=[], **kw)
    return trainer


def main(out: str, run: str, kill_epoch: int | None) -> int:
    trainer = _parts()
    from composer.utils import checkpoint

    d = Path(out) / run
    state = {"saves": 0}

    class Killing:
        """The file torch.save writes into; SIGKILLs the process once KILL_AFTER bytes reached it."""

        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            n = self.f.write(b)
            self.n += n
            if self.n >= KILL_AFTER:
                self.f.flush()
                os.fsync(self.f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)  # inside torch.save: no central directory yet
            return n

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def opening(name, mode="r", *args, **kw):
        f = open(name, mode, *args, **kw)
        if "w" in mode and str(name).endswith(".pt"):
            state["saves"] += 1
            if state["saves"] == kill_epoch:
                return Killing(f)
        return f

    checkpoint.open = opening  # _write_checkpoint_file's `open` (a module global shadows the builtin)
    t = trainer(save_folder=str(d), save_interval="1ep", run_name=run)
    t.fit()
    t.close()
    return 0


def check(out: str, run: str) -> int:
    trainer = _parts()
    d = Path(out) / run
    truth: dict[str, str] = {}
    for p in sorted(d.iterdir()):
        if not p.name.endswith(".pt") or p.is_symlink():
            continue
        try:
            t = trainer(load_path=str(p))
            truth[p.name] = f"loads at batch {int(t.state.timestamp.batch)}"
            t.close()
        except Exception as exc:  # the framework's own verdict
            truth[p.name] = f"{type(exc).__name__}: {exc}"[:200]
    try:
        t = trainer(save_folder=str(d), run_name=run, autoresume=True)
        truth["autoresume"] = f"resumes at batch {int(t.state.timestamp.batch)}"
        t.close()
    except Exception as exc:
        truth["autoresume"] = f"{type(exc).__name__}: {exc}"[:200]
    print(json.dumps(truth))
    return 0


if __name__ == "__main__":
    refuse_in_light_test("Composer (tests/support/fwcomposer.py)")
    if sys.argv[3:] == ["check"]:
        sys.exit(check(sys.argv[1], sys.argv[2]))
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None))
