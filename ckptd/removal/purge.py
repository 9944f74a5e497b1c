"""Purging: the trash emptied from directory file descriptors, never following a symlink and never
entering another filesystem (`fs._remove_tree`). Trash left by a crash is purged at the next start.
What this process did not trash itself waits, and is re-checked against protection as the run
stands then (`Purging._not_yet`). Also what the trash holds for `min_free` (`waiting_in_trash`),
and the priority the purge runs at (`lower_priority`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from ckptd.archive.upload import Archiver
from ckptd.config import pin_matches
from ckptd.decide.planner import Scanner, disk_space, retention_for
from ckptd.discover import layouts
from ckptd.discover.layouts import (
    HIDDEN_TRASH,
    TRASH_DIR,
    recognise_by_contents,
    recognise_with_siblings,
)
from ckptd.discover.runs import find_run
from ckptd.judge.evidence import MOUNT, TooDeep, resume_pointers, walk
from ckptd.model import Candidate, State
from ckptd.removal.decision import RECORD, changed, drop_record, pins_inside, read_record, snapshot
from ckptd.removal.fs import (
    _DIR_FLAGS,
    _another_filesystem,
    _identity,
    _remove_at,
    _rename_noreplace,
    open_dir_nofollow,
)
from ckptd.removal.record import Recorder
from ckptd.removal.trash import REVIEW, Trashing, _trash_origin
from ckptd.volume import mounts, space

log = logging.getLogger(__name__)

WAIT = "not in the trash long enough"  # `Purging._not_yet`
# `Purging._protected`: a checkpoint of the run, other than the entry, is still settling as this
# process sees it (its quiet period not yet over by this settler): the entry waits (WAIT)
SETTLING = "a checkpoint of its run is still settling here"
# An entry whose removal has begun: finished by any later purge, never judged again (`_purge_one`)
PURGING = "%purging"
# `Purging._protected`: the entry's record says it came from another directory than the one its
# origin names now (a run moved away and another made under its name): held for review, never
# put into a run it did not come from
_ELSEWHERE = "its record says it came from another directory"
# `Purging._rejudged`: nothing is at the path its run had (moved, renamed or removed): held for review
_RUN_GONE = "its run is no longer where it was"
# `Purging._archive_gone`: the archive verified before the rename no longer verifies: moved back
_ARCHIVE = "with its archive no longer verified"
# Why the trash cannot be made: full, over quota, read-only, not ours to write (or the root gone)
_NO_TRASH = frozenset({errno.ENOSPC, errno.EDQUOT, errno.ENOENT, errno.EROFS, errno.EACCES, errno.EPERM})


class Purging:
    """A reaper's purge (removal/reaper.py): the trash emptied of what may go, journalled
    (`Recorder`); what this process did not put there itself (its `Ledger`), or whose grace is
    over, judged again first, and moved back where it must stay (`Trashing.undo`)."""

    def __init__(self, scanner: Scanner, recorder: Recorder, trashing: Trashing, archiver: Archiver | None,
                 clock: Callable[[], float], *, dry_run: bool):
        self.scanner = scanner
        self.recorder = recorder
        self.trashing = trashing
        self.ledger = trashing.ledger
        self.root = trashing.root
        self.trash = trashing.trash
        self.archiver = archiver
        self.clock = clock
        self.dry_run = dry_run
        self.purged: dict[Path, int] = {}  # what purging each trash entry freed, by its path
        # What another process trashed (or this one, unconfirmed) waits this long (by its ctime)
        # and is re-checked first. The daemon sets it from its leadership (lease duration + margin
        # for a volume lease; 0 where no other process could have renamed late).
        self.foreign_wait = 0.0
        self.waiting = 0  # entries the last purge left to wait
        self._purging = False

    def purge(self, stop: Callable[[], bool] = lambda: False) -> tuple[int, int]:
        """Delete what may go from the trash. Returns (entries purged, bytes freed).

        Works from a descriptor of the trash directory opened without following
        symlinks, and never follows one inside it. `stop` is asked between
        entries: a daemon shutting down leaves the rest for its next start.
        Checkpoints renamed into the root under a hidden name when there was no room
        for the trash (`HIDDEN_TRASH`) are purged first, by the same rules; then the trash
        is made if it is missing and there is room (at start-up and after each pass: on a
        full disk it is there already).

        Only what this process trashed and confirmed under its fence goes at once. Anything else
        (another host's, an earlier run's, a rename made late by a process stopped before it)
        waits until it has been in the trash `foreign_wait` seconds, enough for a late renamer
        to see it lost the lease and move it back, and is then re-checked against protection as
        it stands (`_protected`): a checkpoint pinned, named by its run's resume pointer, or
        newer than every complete one left in its run is moved back, not purged; while another
        checkpoint of its run is still settling as this process sees it, the entry waits. `%review`
        entries are never purged.
        """
        if self.dry_run:
            return 0, 0
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            log.error("not purging %s: %s", self.root, exc)
            return 0, 0
        self._purging = True
        self.waiting = 0
        try:
            try:
                hidden = sorted(n for n in os.listdir(root_fd) if n.startswith(HIDDEN_TRASH))
                count, freed = self._purge_entries(root_fd, self.root, hidden, stop)
            finally:
                os.close(root_fd)
            try:
                trash_fd = self.trashing.trash_dir.open()
            except OSError as exc:
                # No room (or no right) to make it: nothing is in it either; a rename says why later.
                if exc.errno in _NO_TRASH:
                    log.debug("no %s: %s", self.trash, exc)
                else:
                    log.error("not purging %s: %s", self.trash, exc)
                return count, freed
            try:
                names = sorted(os.listdir(trash_fd))
                more, more_bytes = self._purge_entries(trash_fd, self.trash, names, stop)
            finally:
                os.close(trash_fd)
        finally:
            self._purging = False
        return count + more, freed + more_bytes

    def _purge_entries(
        self, dir_fd: int, where_path: Path, names: list[str], stop: Callable[[], bool]
    ) -> tuple[int, int]:
        """Remove each of `names` in the directory `dir_fd` (at `where_path`) that may go, journalled."""
        count = freed = review = 0
        urgent = self._short_of_space()
        for record in (n for n in names if n.endswith(RECORD)):
            entry_of = record.removesuffix(RECORD)
            if entry_of not in names and f"{entry_of}{PURGING}" not in names:  # purged or restored by another
                drop_record(record.removesuffix(RECORD), dir_fd)
        for entry in (n for n in names if not n.endswith(RECORD)):
            if stop():
                break
            if entry.endswith(REVIEW):
                review += 1
                continue
            if not entry.endswith(PURGING):  # else: its removal begun by an earlier purge (`_claimed`)
                why = self._not_yet(entry, dir_fd, hidden=where_path == self.root, urgent=urgent)
                if why is not None:
                    self.waiting += why == WAIT
                    continue
            size = self._purge_one(entry, dir_fd, where_path)
            if size is not None:
                count += 1
                freed += size
        if review:
            log.warning("%s: %d entries held for review (never purged): move each back or delete it by hand",
                        where_path, review)
        return count, freed

    def _purge_one(self, entry: str, dir_fd: int, where_path: Path) -> int | None:
        """Remove `entry` (in `dir_fd`, at `where_path`), journalled: the bytes it freed, or None.
        Renamed `<entry>%purging` first: a purge killed halfway leaves a part of a checkpoint that
        no later purge mistakes for one changed since its decision (and moves back into its run),
        but finishes removing."""
        name = entry.removesuffix(PURGING)
        path = where_path / name  # as the journal and `purged` name it
        try:
            entries = walk(where_path / entry)
        except TooDeep as exc:
            entries = exc.entries
        except OSError:
            entries = []
        size = space.freed_by(entries)
        where = dict(root=str(self.root), trash=str(path), bytes=size)
        inside = [e.rel for e in entries if e.kind == MOUNT] or mounts.mounts_below(
            where_path / entry, mounts.read_mounts())
        if inside:  # mounted after it was trashed (statx, its device), or in the mount table
            log.error("not purging %s: it holds a mount point (%s)", where_path / entry, inside[0])
            return None  # before its rename: a removal that would stop halfway is not begun
        # The intent first, as for every other step: killed between the removal and the
        # "purged" record, the journal still says this entry was being purged. Unlike a
        # rename, a purge goes ahead when the journal cannot be written (ENOSPC): its
        # entry was journaled when it was trashed, and freeing space is the way out.
        self.recorder.record("purging", **where)
        doomed = f"{name}{PURGING}"
        try:
            if entry != doomed:
                try:
                    _rename_noreplace(entry, dir_fd, doomed, dir_fd)
                except FileNotFoundError:
                    log.warning("not purging %s: restored (or taken by another purge) since it was judged",
                                path)
                    return None
            kept = self._claimed(name, dir_fd, left_by_crash=entry == doomed)
            if kept is not None:
                self.recorder.record("kept", root=str(self.root), trash=str(path), why=kept)
                return None
            _remove_at(doomed, dir_fd)
        except OSError as exc:
            log.error("cannot purge %s: %s", where_path / entry, exc)
            return None
        drop_record(name, dir_fd)
        self.purged[path] = size
        self.ledger.finished.discard(name)
        self.ledger.due.pop(name, None)
        log.debug("purged %s (%d bytes)", path, size)
        self.recorder.record("purged", **where)
        return size

    def _claimed(self, name: str, dir_fd: int, *, left_by_crash: bool) -> str | None:
        """Judged again once its `%purging` rename made the entry this purge's (a restore's rename
        made first wins; one made after finds nothing): why it is kept, or None: remove it. A pin
        (a `.ckptd-keep` at any depth, the config's) or contents other than its record saw: renamed
        back to `name`, judged again by the next purge. One a killed purge left (`left_by_crash`)
        is removed unless pinned; pinned, it goes back where its contents are still what its record
        saw, and is held for review where part of it is removed already."""
        try:
            seen = snapshot(f"{name}{PURGING}", dir_fd)
        except OSError as exc:
            return self._unclaim(name, dir_fd, f"cannot look at it ({exc})", review=True)
        origin = _trash_origin(name) or _origin_from_record(name, dir_fd)
        rel = origin[0] if origin is not None and not origin[1] else None  # a slim's files: no config pin
        config_pins = retention_for(self.scanner.root, rel.rpartition("/")[0] or ".")[0].pins if rel else ()
        pinned = pins_inside(seen) or [p for p in config_pins if rel and pin_matches(rel, p)]
        record = read_record(name, dir_fd)
        contents = record.get("contents") if record is not None else None
        diff = None if not isinstance(contents, list) else changed(
            contents, [row for row in seen if row not in _pin_rows(seen)])
        if left_by_crash:
            if not pinned:
                return self._judged_after_crash(name, dir_fd, rel,
                                                whole=isinstance(contents, list) and diff is None)
            if not isinstance(contents, list):  # nothing says it is whole
                diff = "no decision record to compare it with"
            why = self._unclaim(name, dir_fd, f"pinned ({pinned[0]}) after its purge began",
                                review=diff is not None)
            return why if diff is not None else self._back_now(name, dir_fd, rel, why)
        if pinned:
            why = self._unclaim(name, dir_fd, f"pinned ({pinned[0]}) as its purge began", review=False)
            return self._back_now(name, dir_fd, rel, why)
        if diff is not None:
            return self._unclaim(name, dir_fd, f"changed as its purge began ({diff})", review=False)
        return None

    def _judged_after_crash(
        self, name: str, dir_fd: int, rel: str | None, *, whole: bool
    ) -> str | None:
        """An unpinned `<name>%purging` a killed purge left: why it is kept, or None: remove it.
        Still whole (its contents what its decision record saw): renamed back and judged afresh
        (`_rejudged`: pins, its run's anchors, and the archive gate where one is required), then
        claimed again only if that judgement lets it go; a keep puts it back into its run (or holds
        it). Otherwise (part of it removed, or no record to tell) while an archive is required: the
        removal was allowed by an archive that may no longer verify, so the archive is judged again
        (what is left of it must be what was archived, `_archive_gone`); finished only where it
        verifies, else held for review (it cannot go back into its run whole). With no archive
        required (or a slim's files) its removal is finished as the decision made it: what is left is
        no checkpoint any more, and a pin was looked for above."""
        if whole and rel is not None:
            try:
                _rename_noreplace(f"{name}{PURGING}", dir_fd, name, dir_fd)
            except OSError as exc:
                log.error("%s/%s%s: its purge was interrupted, and it cannot be renamed back to be judged "
                          "again (%s): left as it is", TRASH_DIR, name, PURGING, exc)
                return f"cannot be judged again ({exc.strerror})"
            why = self._rejudged(name, dir_fd, rel)
            if why is not None:
                return why
            try:
                _rename_noreplace(name, dir_fd, f"{name}{PURGING}", dir_fd)
            except OSError as exc:
                return f"cannot claim it again ({exc.strerror})"
            return None
        why = None if rel is None else self._archive_gone(f"{name}{PURGING}", dir_fd, rel, part_removed=True)
        if why is not None:
            return self._unclaim(name, dir_fd, f"its purge was interrupted {why}", review=True)
        return None

    def _back_now(self, name: str, dir_fd: int, rel: str | None, why: str) -> str:
        """A pinned entry renamed back from `%purging`: judged again at once (`_rejudged`), so it
        goes back into its run (or is held) now, not after another grace."""
        if rel is None or not _exists(name, dir_fd):
            return why
        return self._rejudged(name, dir_fd, rel) or why

    def _unclaim(self, name: str, dir_fd: int, why: str, *, review: bool) -> str:
        """Rename `<name>%purging` back to `name` (or to `<name>%review`, never purged): says why."""
        back = f"{name}{REVIEW}" if review else name
        try:
            _rename_noreplace(f"{name}{PURGING}", dir_fd, back, dir_fd)
        except OSError as exc:
            log.error("%s/%s%s: %s, and cannot be renamed %s (%s): left as it is: look at it by hand",
                      TRASH_DIR, name, PURGING, why, back, exc)
            return why
        if review:
            drop_record(name, dir_fd)
            log.error("%s/%s: %s; part of it is removed already: held for review as %s, never purged",
                      TRASH_DIR, name, why, back)
        else:
            log.warning("%s/%s: %s: not purged, renamed back (the next purge judges it again)",
                        TRASH_DIR, name, why)
        return why

    def trash_pending(self) -> bool:
        """Whether the trash holds what a purge should look at: what this process did not put
        there (another process's, maybe a late rename), or what it did whose `trash_grace` is
        over. The daemon asks at each poll. A name listing, nothing more; False while a purge runs."""
        if self.dry_run or self._purging:
            return False
        try:
            names = os.listdir(self.trash)
        except OSError:
            return False
        now = self.clock()
        return any(
            (n not in self.ledger.finished or self.ledger.due.get(n, 0.0) <= now) and not n.endswith((REVIEW, RECORD))
            for n in names
        )

    def _short_of_space(self) -> bool:
        """Whether the root's filesystem is below its `min_free` now: the purge then takes what may
        go from the trash without waiting out `trash_grace` (what waits there is what min_free
        counted as free). Not when it cannot tell: waiting is the safe side."""
        floor = self.scanner.root.retention.min_free
        if floor is None:
            return False
        try:
            disk = disk_space(self.root)
        except OSError:
            return False
        return disk.free < floor.required(disk.total)

    def _not_yet(self, entry: str, trash_fd: int, *, hidden: bool = False, urgent: bool = False) -> str | None:
        """Why an entry is not purged now (WAIT: it has not been in the trash long enough; else it
        was moved back, or held), or None: purge it. A checkpoint waits `trash_grace` (unless
        `urgent`: min_free needs the space), and one this process did not trash at least
        `foreign_wait` as well, by its ctime (a rename sets it: the time it came in); then it is
        judged again (`_rejudged`). A slim's or a consolidation's files this process moved go at
        once. `hidden`: a `.ckptd-trash.*` name at the root's top, not in the trash: one whose
        name does not say where it came from is not something ckptd moved aside (a person's, or a
        spoof), and is left alone."""
        try:
            ctime = os.stat(entry, dir_fd=trash_fd, follow_symlinks=False).st_ctime
        except FileNotFoundError:
            return "gone"
        origin = _trash_origin(entry)
        if origin is None and not hidden:  # a rel too long for a name: its record says
            origin = _origin_from_record(entry, trash_fd)
        whole = origin is not None and not origin[1]  # a whole checkpoint, not a slim's files
        own = entry in self.ledger.finished
        grace = 0.0 if urgent or not whole else self.ledger.grace
        if own and self.clock() < self.ledger.due.get(entry, 0.0) - self.ledger.grace + grace:
            return WAIT
        if not own and self.clock() - ctime < max(self.foreign_wait, grace):
            return WAIT
        if own and not whole:
            return None
        if origin is None and hidden:
            log.warning("%s: not named as ckptd names what it moves aside: left alone, never purged",
                        self.root / entry)
            return "not ckptd's"
        if origin is None:
            # Neither its name nor a record says where it came from (renamed in the trash, or put
            # there by hand): nothing to judge it against, so never purged by itself.
            log.error("%s/%s: neither its name nor a decision record says where it came from: held for "
                      "review, never purged: move it back by hand, or delete it by hand", TRASH_DIR, entry)
            self._hold(entry, trash_fd)
            return "origin unknown"
        if origin[1]:
            # A slim's optimizer files, a consolidation's work: purged, unless a
            # pin is at its top (a pinned checkpoint moved in by hand, or under a name made to
            # look like a slim's): with nowhere known to move it back to, held for review.
            if _identity(f"{entry}/{layouts.PIN_FILE}", trash_fd) is not None:
                log.error("%s/%s holds a %s: held for review, never purged: move it back by hand",
                          TRASH_DIR, entry, layouts.PIN_FILE)
                self._hold(entry, trash_fd)
                return "pinned"
            return None
        return self._rejudged(entry, trash_fd, origin[0])

    def _hold(self, entry: str, trash_fd: int) -> None:
        """Rename a trash entry `<entry>%review`: never purged, for a person to look at."""
        with contextlib.suppress(OSError):
            os.rename(entry, f"{entry}{REVIEW}", src_dir_fd=trash_fd, dst_dir_fd=trash_fd)
            drop_record(entry, trash_fd)

    def _rejudged(self, entry: str, trash_fd: int, rel: str) -> str | None:
        """The purge's judgement of a checkpoint in the trash, afresh, under the config in force
        now (`_protected`): None, purge it; WAIT; else why it went back to `rel` (beside it where
        its name is taken) or is held for review."""
        run_rel, _, name = rel.rpartition("/")
        try:
            run_fd = open_dir_nofollow(self.root, run_rel or ".")
        except FileNotFoundError:
            # Its run is not at the path its record names: moved or renamed away (maybe out of the
            # root after a crash skipped the after-rename check), or removed. Where it went its
            # newest may be gone and a pin may be there; that cannot be seen from here: held.
            why = f"{_RUN_GONE} ({self.root / (run_rel or '.')})"
            log.error("%s/%s: %s: held for review, never purged: move it back into its run "
                      "where the run is now, or delete it by hand", TRASH_DIR, entry, why)
            self._hold(entry, trash_fd)
            return why
        except OSError as exc:
            log.error("%s/%s: its run cannot be opened (%s): held for review, never purged",
                      TRASH_DIR, entry, exc)
            self._hold(entry, trash_fd)
            return f"its run cannot be opened ({exc.strerror})"
        try:
            try:
                why = self._protected(entry, trash_fd, rel, run_fd)
            except OSError as exc:
                why = f"cannot re-check it ({exc})"
            if why is None:
                return None
            if why == SETTLING:
                return WAIT
            if why.startswith(_ELSEWHERE):
                log.error("%s/%s: %s: held for review, never purged", TRASH_DIR, entry, why)
                self._hold(entry, trash_fd)
                return why
            # Another process's entry (maybe a late renamer's) is told as before; this process's own
            # was judged again after its grace (as is any whose archive no longer verifies: nothing
            # to do with a lease)
            own = entry in self.ledger.finished or why.startswith(_ARCHIVE)
            how = "and judged again at its purge" if own else "without the lease"
            undone = self.trashing.undo(entry, trash_fd, name, run_fd, rel, f"found in the trash {why}",
                                beside=True, how=how)
            return f"{why}: {undone}"
        finally:
            os.close(run_fd)

    def _protected(self, entry: str, trash_fd: int, rel: str, run_fd: int) -> str | None:
        """Why a checkpoint found in the trash must go back to `rel` (its run open as `run_fd`),
        as the run stands now and under the config in force now: a pin (the config's, beside it,
        or a `.ckptd-keep` at any depth inside), contents other than its decision's record saw,
        its run's resume pointer, or one of its run's anchors it would be (`_an_anchor`)."""
        run_rel, _, name = rel.rpartition("/")
        run_rel = run_rel or "."
        run_path = self.root if run_rel == "." else self.root / run_rel
        is_dir = stat.S_ISDIR(os.stat(entry, dir_fd=trash_fd, follow_symlinks=False).st_mode)
        names = os.listdir(run_fd)
        retention, _ = retention_for(self.scanner.root, run_rel)
        record = read_record(entry, trash_fd)
        why = None if record is None else _against_record(record, run_rel, name, run_fd)
        if why is not None:
            return why
        now_seen = snapshot(entry, trash_fd)
        inside = pins_inside(now_seen)
        if inside or f"{name}{layouts.PIN_FILE}" in names or any(pin_matches(rel, p) for p in retention.pins):
            return "pinned"
        diff = None if record is None else changed(record["contents"], now_seen)
        if diff is not None:
            return f"changed since it was trashed ({diff})"
        pointer = resume_pointers(run_path, names).get(name)
        if pointer is not None:
            return f"named by {pointer}"
        # by its name, or among its run's files (Keras's saves of one template: `recognise_among`),
        # or by a look inside, as discovery recognised it (an Orbax step is `1/` only with Orbax's files)
        mine = recognise_with_siblings(name, is_dir, names, self.scanner.patterns)
        if mine is None and is_dir:
            mine = recognise_by_contents(name, os.listdir(f"/proc/self/fd/{trash_fd}/{entry}"))
        if mine is None:
            return "not recognised by its name or contents, so not known to be older than the run's newest"
        return (self._an_anchor(entry, trash_fd, run_rel, name, mine)
                or self._archive_gone(entry, trash_fd, rel))

    def _archive_gone(
        self, entry: str, trash_fd: int, rel: str, *, part_removed: bool = False
    ) -> str | None:
        """With `[roots.archive] required`: why the archive the reaper verified before the rename no
        longer allows the removal (its manifest or an object gone or changed during the grace, the
        store unreachable: archive/gate.py, asked of the entry's files in the trash), or None.
        Asked last: it reads the store. A keep like any other: the entry goes back into its run,
        where the next pass archives it again (or keeps it, saying why). `part_removed`: of what a
        purge killed halfway left (`_judged_after_crash`)."""
        if self.archiver is None:
            return None
        run_rel, _, name = rel.rpartition("/")
        path = Path(f"/proc/self/fd/{trash_fd}") / entry
        why = self.archiver.problem_at(run_rel or ".", name, path, part_removed=part_removed)
        return None if why is None else f"{_ARCHIVE} ({why})"

    def _an_anchor(self, entry: str, trash_fd: int, run_rel: str, name: str, mine: Candidate) -> str | None:
        """Why the trash's `entry` (checkpoint `name` of `run_rel`, recognised as `mine`) would be
        one of its run's anchors if it went back now, or None."""
        # It may go only if it would be neither of the run's anchors now: some complete checkpoint
        # left is newer by step, and some is newer by time (its save ended after every file of
        # this entry was written: a new job's lower steps, written last, are the newest by time).
        entries = walk(Path(f"/proc/self/fd/{trash_fd}") / entry)
        written = max((e.mtime_ns for e in entries if e.kind == "f"), default=entries[0].mtime_ns) / 1e9
        run = find_run(self.root, run_rel, patterns=self.scanner.patterns)
        now = self.clock()
        by_step = by_time = settling = False
        candidates = run.candidates if run is not None else ()
        others = [c for c in candidates if c.unit == mine.unit and c.name != name]
        for cand in sorted(others, key=lambda c: c.step, reverse=True):
            fresh = self.scanner.reinspect(run_rel, cand.name, now=now)
            # The daemon's settler judges quiet by what this process itself saw: a leader that
            # has just taken over sees the newer checkpoint the previous one had settled as
            # settling for up to quiet_period. Not known complete yet, nor known not to be: the
            # entry waits for that, rather than going back as if renamed without the lease.
            settling = settling or (fresh is not None and fresh.state is State.SETTLING)
            if fresh is None or fresh.state is not State.COMPLETE:
                continue
            by_step = by_step or fresh.step > mine.step
            by_time = by_time or fresh.written_at >= written
            if by_step and by_time:
                return None
        if settling:
            return SETTLING
        return "newer than every complete checkpoint left in its run (by step or by time)"


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _pin_rows(seen: list[list[object]]) -> list[list[object]]:
    pins = set(pins_inside(seen))
    return [row for row in seen if row[0] in pins]


def _origin_from_record(entry: str, trash_fd: int) -> tuple[str, str] | None:
    """(rel, "") from the entry's decision record where its name does not say (a rel too long for a
    name), or None: no record, or one that names no checkpoint."""
    record = read_record(entry, trash_fd)
    if record is None:
        return None
    run, name = record.get("run"), record.get("name")
    if not isinstance(run, str) or not isinstance(name, str) or not name or "/" in name:
        return None
    rel = os.path.normpath(f"{run}/{name}")
    if rel.startswith(("/", "..")):
        return None
    return rel, ""


def _against_record(record: dict[str, object], run_rel: str, name: str, run_fd: int) -> str | None:
    """Why the run open as `run_fd` is not the one the entry's record names (`_ELSEWHERE`), or None.
    The inode alone: a network filesystem's device number changes from one mount to the next."""
    run_id = record.get("run_id")
    if record.get("run") != run_rel or record.get("name") != name:
        return f"{_ELSEWHERE} ({record.get('run')}/{record.get('name')}, not {run_rel}/{name})"
    if isinstance(run_id, list) and len(run_id) == 2 and run_id[1] != os.fstat(run_fd).st_ino:
        return f"{_ELSEWHERE} (the run {run_rel} was replaced since it was trashed)"
    return None


def waiting_in_trash(root: Path) -> int:
    """What purging `root`'s trash frees, however long its entries still wait (another process's
    wait `foreign_wait`; one a killed prune left): `min_free` counts it as free already, so it
    deletes nothing more for space a purge frees anyway. The trash's entries and what was renamed
    into the root's top under ckptd's hidden name; not those held for review, nor a hidden name
    ckptd did not give (never purged: `Reaper._not_yet`), nor a trash on another filesystem."""
    total = 0
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        for name in os.listdir(root_fd):
            ours = name.startswith(HIDDEN_TRASH) and (name.endswith(PURGING) or _trash_origin(name) is not None)
            if ours and not name.endswith(REVIEW):
                total += _size(root / name)
        try:
            trash_fd = os.open(TRASH_DIR, _DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            return total
        try:
            if _another_filesystem(TRASH_DIR, root_fd, trash_fd, root / TRASH_DIR) is not None:
                return total
            for name in os.listdir(trash_fd):
                if not name.endswith((REVIEW, RECORD)):
                    total += _size(root / TRASH_DIR / name)
        finally:
            os.close(trash_fd)
    except OSError:
        return total
    finally:
        os.close(root_fd)
    return total


def _size(path: Path) -> int:
    """What removing `path` frees now: allocated blocks of the inodes whose every link is inside
    it (a file hard-linked from a checkpoint that stays frees nothing: space.py)."""
    try:
        return space.freed_by(walk(path))
    except TooDeep as exc:
        return space.freed_by(exc.entries)
    except OSError:
        return 0


def lower_priority() -> None:
    """Make the calling thread nice 19 and idle I/O class, so purging yields to training I/O.

    Both are per-thread on Linux (setpriority and ioprio_set take a thread id).
    Best effort: a sandbox may forbid either.
    """
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except OSError as exc:
        log.debug("cannot lower CPU priority: %s", exc)
    number = {"x86_64": 251, "aarch64": 30}.get(os.uname().machine)
    if number is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ioprio_who_process, ioprio_class_idle = 1, 3
        if libc.syscall(number, ioprio_who_process, tid, ioprio_class_idle << 13) != 0:
            log.debug("cannot set idle I/O priority: %s", os.strerror(ctypes.get_errno()))
    except OSError as exc:
        log.debug("cannot set idle I/O priority: %s", exc)
