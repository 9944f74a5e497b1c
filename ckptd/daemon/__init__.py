"""`ckptd run`: the asyncio daemon (`Daemon`, core.py, which wires the rooms of this package), and
the state files it leaves for `ckptd status` and `ckptd health` (`read_states`, `STATE_PREFIX`)."""

from ckptd.daemon.core import Daemon
from ckptd.daemon.status import STATE_PREFIX, read_states

__all__ = ["STATE_PREFIX", "Daemon", "read_states"]
