"""What every benchmark is handed: where to work, which volumes, how hard to try."""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import volume
from bench.volume import Shape, Volume
from ckptd.judge import verdicts


@dataclass
class Context:
    workdir: Path
    sizes: list[Shape]  # the volumes to measure on, smallest first
    quick: bool  # tiny sizes and few repetitions: the CI smoke run
    torch_version: str | None  # None: torch not installed, rows that need it are skipped
    volumes: dict[str, Volume] = field(default_factory=dict)
    built: list[str] = field(default_factory=list)  # how each volume came out, for the report
    facts: dict[str, float] = field(default_factory=dict)  # one benchmark's figures another reuses

    def log(self, msg: str) -> None:
        print(f"  {msg}", file=sys.stderr, flush=True)

    def reps(self, shape: Shape | None = None) -> int:
        """Repetitions for a timing: fewer on bigger volumes, 2 in quick mode."""
        if self.quick:
            return 2
        if shape is None:
            return 7
        return {"S": 7, "M": 5}.get(shape.name, 3)

    def volume(self, shape: Shape) -> Volume:
        """The volume of this shape, built on first use and shared by every benchmark."""
        if shape.name not in self.volumes:
            self.log(f"building volume {shape.describe()}")
            t0 = time.perf_counter()
            v = volume.build(self.workdir / "volumes", shape, now=time.time())
            took = time.perf_counter() - t0
            # ckptd trusts no look at a file whose ctime is within a timestamp tick of the look
            # (verdicts.RACY_NS: a write in the same tick would not show): measured at once, a volume
            # just built is walked and read again at every reconcile, as a daemon would on a save that
            # just landed. Its ctimes cannot be set, so the benchmarks wait the tick out.
            time.sleep(max(0.0, t0 + took + verdicts.RACY_NS / 1e9 - time.perf_counter()))
            self.volumes[shape.name] = v
            self.built.append(f"{shape.describe()}; built in {took:.1f} s")
        return self.volumes[shape.name]

    def scratch(self, name: str) -> Path:
        """An empty directory for one benchmark's own files."""
        path = self.workdir / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.workdir).free
