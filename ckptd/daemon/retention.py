"""The retention pass (`Retention`): one plan across every root (min_free is per filesystem), each
leader's reaper acting on its part of it, and what the log and the state file say of the
decisions. On the filesystem thread."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptd.config import Root, format_size
from ckptd.daemon.consolidation import Waiting
from ckptd.daemon.metrics import unmet_budgets
from ckptd.daemon.narration import IN_FLIGHT
from ckptd.decide.planner import decide
from ckptd.decide.policy import Decision
from ckptd.model import Action, State
from ckptd.removal.outcome import DRY_RUN_NOTE, Outcome, Result
from ckptd.removal.recheck import FENCED

if TYPE_CHECKING:
    from ckptd.daemon.consolidation import Consolidations
    from ckptd.daemon.narration import Narrator
    from ckptd.daemon.roots import RootKeeper, RootRuntime
    from ckptd.daemon.state import DaemonState

# One logger for all of the daemon's rooms: its name is in every JSON log line ("logger").
log = logging.getLogger("ckptd.daemon")

# Retention (a plan across every root) runs at most this often: in a save storm each tick completes
# a few checkpoints, and a pass per tick held the filesystem thread from its next looks.
RETENTION_MIN_INTERVAL = 1.0


class Retention:
    """Decides, lets the leaders' reapers act, and remembers what was decided and said.

    Handed the shared state, the keeper (leadership, the purge, free space counting the trash),
    the narrator (the totals line), the consolidations (slims waiting for fp32 weights), and
    `interrupted` (why a pass must stop before its next deletion: a stop, a reload)."""

    def __init__(
        self,
        state: DaemonState,
        *,
        keeper: RootKeeper,
        narrator: Narrator,
        consolidations: Consolidations,
        interrupted: Callable[[], str | None],
    ):
        self.state = state
        self.keeper = keeper
        self.narrator = narrator
        self.consolidations = consolidations
        self.interrupted = interrupted
        self.decisions: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}  # by (root, rel)
        self.version = 0  # bumped when `decisions` changes (the state file's cache)
        self.said_actions: dict[tuple[str, str], str] = {}  # what the log last said each would do
        self.ran = -1e9
        self.due: float | None = None  # a pass put off by RETENTION_MIN_INTERVAL runs then

    def when_due(self, now: float, wanted: bool) -> None:
        """Run a pass if one is `wanted` or one put off is due, at most every RETENTION_MIN_INTERVAL."""
        if wanted or (self.due is not None and now >= self.due):
            wanted = now - self.ran >= RETENTION_MIN_INTERVAL
            self.due = None if wanted else self.ran + RETENTION_MIN_INTERVAL
        if wanted:
            self.ran = now
            try:
                self.run()
            except OSError as exc:  # statvfs, a re-check's walk: skip this pass, the next one retries
                log.error("retention skipped this time: %s", exc)

    def run(self) -> None:
        """Decide across every root (min_free is per filesystem), then let each leader's reaper act."""
        d = self.state
        runs = [(rt.root, rt.tracker.current_runs(resume=True)) for rt in d.roots]
        plan = decide(runs, space=self.keeper.space)
        for w in plan.warnings:
            log.warning("%s", w)
        if d.metrics is not None:
            d.metrics.budgets = {str(rt.root.path): configured_budgets(rt.root) for rt in d.roots}
            d.metrics.budgets_unmet = unmet_budgets(
                plan.warnings, plan.decisions, (str(rt.root.path) for rt in d.roots)
            )
        news = self.log_decisions(plan.decisions)
        done = {"deleted": 0, "slimmed": 0, "freed": 0, "would delete": 0, "would slim": 0}
        waiting: list[Waiting] = []  # slims whose fp32 weights are to be consolidated first
        for rt in d.roots:
            if self.interrupted() is not None:  # said by the root whose pass it stopped
                break
            self.keeper.try_lead(rt)
            if (not rt.leader or rt.catching_up) and not d.dry_run:
                continue
            mine = [x for x in plan.decisions if x.checkpoint.root == rt.root.path]
            # [roots.archive] when = "on-complete": the reaper archives every complete one, kept or not
            archiver = rt.reaper.archiver
            on_complete = archiver is not None and archiver.cfg.when == "on-complete"
            if not on_complete and not any(x.action in (Action.DELETE, Action.SLIM) for x in mine):
                continue
            self._act(rt, mine, done, waiting)
        self.narrator.totals(plan.decisions, done, news)
        self.consolidations.schedule(plan.decisions, waiting)
        self._forget_gone(plan.decisions)

    def _act(
        self, rt: RootRuntime, mine: list[Decision], done: dict[str, int], waiting: list[Waiting]
    ) -> None:
        """One root's reaper carries out its part of the plan; a slim whose weights are to be
        consolidated first waits (`Consolidations.schedule`)."""
        trashed = False
        # Fencing: each rename asks whether this ckptd still leads, under the epoch held now.
        rt.reaper.fence = None if self.state.dry_run else self._fence(rt)
        rt.reaper.interrupted = self.interrupted
        fenced = False
        for result in rt.reaper.execute(mine, consolidate=False):
            if result.outcome is Outcome.DEFERRED:
                waiting.append((rt, result))
                continue
            if self._carried_out(rt, result, done):
                trashed = True
            fenced = fenced or (result.outcome is Outcome.REFUSED and result.detail.startswith(FENCED))
        if fenced:
            # Refused by the fence: a read of etcd that timed out, a renewal late on a loaded host.
            # Nothing on the volume changes for that, so no event would bring the pass back before
            # the next reconcile (minutes): it is tried again after the lead's next renewal. A
            # ckptd that lost the lead meanwhile stands by at that pass instead.
            wait = max(RETENTION_MIN_INTERVAL, float(getattr(rt.lead, "interval", RETENTION_MIN_INTERVAL)))
            self.due = min(self.due if self.due is not None else float("inf"), self.ran + wait)
            log.debug("%s: a rename refused by the fence; retention again in %.1fs", rt.root.path, wait)
        if rt.reaper.stopped is not None:
            why, before, left = rt.reaper.stopped
            log.warning("%s: retention pass stopped before %s (%d deletion(s) or slim(s) not done): %s; "
                        "what is left is decided again", rt.root.path, before, left, why,
                        extra={"root": str(rt.root.path)})
        if trashed:
            self.keeper.purge(rt)

    def _fence(self, rt: RootRuntime) -> Callable[[], str | None]:
        """What the reaper asks just before each rename: that this ckptd still leads (its epoch), and
        still stands on the lock and journal it took (`RootKeeper.footing`)."""
        lead, footing = rt.lead.fencer(), self.keeper.footing

        def fence() -> str | None:
            why = lead()
            if why is None and (lost := footing(rt)) is not None:
                why = f"lost its footing: {lost}"
            return why

        return fence

    def _carried_out(self, rt: RootRuntime, result: Result, done: dict[str, int]) -> bool:
        """Count and say one thing the reaper did (or would do, or refused); True when it moved
        something to the trash."""
        d = self.state
        c = result.decision.checkpoint
        action = str(result.decision.action)
        verb = "deleted" if action == "delete" else "slimmed"
        extra = {
            "root": str(rt.root.path),
            "run": c.run,
            "checkpoint": c.name,
            "action": action,
            "reasons": list(result.decision.reasons),
            "outcome": str(result.outcome),
            "dry_run": d.dry_run,
        }
        if result.outcome in (Outcome.TRASHED, Outcome.SLIMMED):
            d.counters[verb] += 1
            moved = c.size_bytes if result.outcome is Outcome.TRASHED else result.moved_bytes
            done[verb] += 1
            done["freed"] += moved
            if result.outcome is Outcome.TRASHED:
                rt.tracker.forget(c.rel)  # no news for the narrator: said here, as a deletion
            else:
                rt.tracker.look_again(c.rel)  # slimmed: not the checkpoint the plan saw
            reasons = "; ".join(result.decision.reasons)
            log.info("%s %s (%s): %s", verb, c.rel, format_size(moved), reasons, extra=extra)
            return True
        if result.outcome is Outcome.DRY_RUN:
            done[f"would {action}"] += 1
            log.debug("would %s %s: %s %s", action, c.rel, result.detail, DRY_RUN_NOTE, extra=extra)
            return False
        d.counters[str(result.outcome)] += 1
        if result.outcome is Outcome.REFUSED:
            # Changed since the tracker settled it (a re-save in place, say): complete
            # checkpoints are walked again only at reconcile, so look now (and at its anchor).
            rt.tracker.refused(c.rel)  # the disk differs from what the plan was made of
        if rt.outcomes.get(c.rel) != result.detail:  # once per reason, not every pass
            rt.outcomes[c.rel] = result.detail
            level = logging.ERROR if result.outcome is Outcome.FAILED else logging.WARNING
            what = "deleting" if action == "delete" else "slimming"
            log.log(level, "not %s %s: %s", what, c.rel, result.detail, extra=extra)
        return False

    def _forget_gone(self, decisions: tuple[Decision, ...]) -> None:
        """Forget what was said about checkpoints that are gone (a path re-created later is news again)."""
        current = {(str(d.checkpoint.root), d.checkpoint.rel) for d in decisions}
        kept = {k: v for k, v in self.decisions.items() if k in current}
        if len(kept) != len(self.decisions):
            self.decisions, self.version = kept, self.version + 1
        self.said_actions = {k: v for k, v in self.said_actions.items() if k in current}
        for rt in self.state.roots:
            rels = {c.rel for c in rt.tracker.checkpoints()}
            rt.outcomes = {k: v for k, v in rt.outcomes.items() if k in rels}

    def log_decisions(self, decisions: tuple[Decision, ...]) -> int:
        """Log a checkpoint's decision when its action changes, in plan order (root, run, step).

        At INFO: a complete checkpoint's first decision, and any change of action (keep ->
        delete, keep -> slim); a keep waits until nothing in its run is settling, so that the
        checkpoints found at start (which complete milliseconds apart) are not said to be kept
        as "newest complete" one moment and deleted the next. A kept checkpoint's reasons
        shift with every save (`keep_last=2 (#2 newest)`), and one in flight is kept because
        it is in flight (its state line said so): those are debug lines. Returns how many
        deletions and slims were news.
        """
        news_acting = 0
        dry_run = self.state.dry_run
        note = f" {DRY_RUN_NOTE}" if dry_run else ""
        busy = {(c.root, c.run) for d in decisions if (c := d.checkpoint).state in IN_FLIGHT}
        for d in decisions:
            c = d.checkpoint
            key = (str(c.root), c.rel)
            value = (str(d.action), d.reasons)
            changed = self.decisions.get(key) != value
            if changed:
                self.decisions[key] = value
                self.version += 1
            acting = d.action is not Action.KEEP
            news = (
                c.state is State.COMPLETE
                and self.said_actions.get(key) != value[0]
                and (acting or (c.root, c.run) not in busy)
            )
            if not (news or changed):
                continue
            if news:
                self.said_actions[key] = value[0]
                news_acting += acting
            log.log(
                logging.INFO if news and acting else logging.DEBUG,  # a keep is said by `Narrator.totals`
                "decide %s%s",
                d.line(),
                note if acting else "",
                extra={
                    "root": str(c.root),
                    "run": c.run,
                    "checkpoint": c.name,
                    "action": str(d.action),
                    "reasons": list(d.reasons),
                    "dry_run": dry_run,
                },
            )
        return news_acting


def configured_budgets(root: Root) -> tuple[str, ...]:
    """The budget keys a root sets, in [roots.retention] or any run rule (ckptd_budget_unmet's labels)."""
    rules = (root.retention, *root.runs)
    keys = ("max_size", "min_free", "keep_total")
    return tuple(k for k in keys if any(getattr(r, k) is not None for r in rules))
