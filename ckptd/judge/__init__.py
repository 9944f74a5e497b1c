"""Is a checkpoint complete? Evidence from its files, whole-file checks, weights, commit records,
settling, and the verdict cache."""
