"""`ckptd run`: the asyncio daemon (`Daemon`), and the state files it leaves for `ckptd status`
and `ckptd health` (`read_states`, `STATE_PREFIX`)."""

from ckptd.daemon.core import STATE_PREFIX, Daemon, read_states

__all__ = ["STATE_PREFIX", "Daemon", "read_states"]
