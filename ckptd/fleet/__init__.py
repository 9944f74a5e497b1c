"""One deleter per root: the local root lock, the volume lease and its record, the engine backends."""
