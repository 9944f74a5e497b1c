"""Where the frameworks' metric readers lived: they are in their modules now (Lightning's and NeMo's
names and ModelCheckpoint state in frameworks/lightning.py, Orbax's metrics item in
frameworks/orbax.py). Kept only for evidence.py's `fwmetrics.CkptScores`, until the engine takes
the scores cache from the framework."""

from ckptd.frameworks.lightning import CkptScores

__all__ = ["CkptScores"]
