"""Finding runs under a root and recognising their checkpoints. Reads only."""
