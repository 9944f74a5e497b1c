"""The only package that deletes: `Reaper` (reaper.py) carries out a root's plan, one module per job.

Deleting a checkpoint is two steps:
1. rename it into `<root>/.ckptd-trash/<unique>` (trash.py): O(1) on one filesystem,
   and the checkpoint leaves its run atomically, so a trainer's auto-resume
   never sees half a checkpoint;
2. purge the trash from directory file descriptors (purge.py), never following a
   symlink and never entering another filesystem (`fs._remove_tree`). Trash left
   by a crash is purged at the next start.

Just before the rename, every target is checked again, afresh from disk (recheck.py):
still inside its root with no symlink on the way, not a symlink itself,
still complete, unchanged since the plan was made (same fingerprint), still
quiet, not pinned, holding no mount point, not named by the framework's resume
pointer, and each of the run's anchors (its newest complete and full
checkpoints by step and by time, which the plan kept) still there, complete
and unchanged. Then the whole run is read again, strictly, and decided again by
the same rules: it acts only if that decision does the same (a file rewritten in
place, its mtime kept, changes no fingerprint, but may change which checkpoint is
best). Any doubt and it is left alone.

The journal records the intent before the rename, and each outcome after (record.py).

Fencing: where several ckptd could lead (lease.py), the reaper asks `fence` immediately
before each rename that removes something from a checkpoint or a run (into the trash,
a slim's optimizer files, the consolidated weights into place): it answers why this
process may no longer act, or None. A refusal leaves everything where it is.

Slimming (`slim_one`, slimming.py) removes only a checkpoint's optimizer files, the same
way: re-checked first, renamed into the trash, purged later. When the
checkpoint has no fp32 weights of its own they are consolidated first, and
nothing is removed unless that output verified; see `slim_one` for what a
crash at each step leaves. The consolidation itself only adds a directory
(`begin_consolidation`, `finish_consolidation`, consolidation.py): the daemon runs it on a worker
of its own and slims in a later pass, as a checkpoint that holds its weights.

Every removal goes through the descriptor-level primitives of fs.py. The root locks are beside
the lease (ckptd/fleet/locks.py).
"""
