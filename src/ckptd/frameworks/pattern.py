"""A user's pattern (`[[roots.patterns]] name = "ckpt_{step}"`): the evidence the user names for it.

`require` globs each a file that must be there, `ranks` a per-rank file with `{rank}` (counted as
the frameworks' rank files are). Without either, nothing but quiet says a save is finished, and
`plan` warns so.
"""

from __future__ import annotations

import re

from ckptd import slim
from ckptd.frameworks.base import Evidence, Framework, Save, _known_world, _rank_files
from ckptd.model import Check, Entry, Verdict

PASSED, FAILED = Verdict.PASSED, Verdict.FAILED

LAYOUT = "pattern"
EVIDENCE = "evidence"
QUIET_ALONE = "no completion evidence: complete on quiet alone, the weakest evidence there is"


def _required(files: dict[str, Entry], glob: str) -> Check:
    """A file the user's pattern requires (`require`)."""
    hit = next((rel for rel, e in files.items() if e.kind == "f" and rel and slim.matches(rel, glob)), None)
    if hit is None:
        return Check(f"requires {glob}", FAILED, "no such file")
    return Check(f"requires {glob}", PASSED, f"{hit} present")



class UserPattern(Framework):
    layout = LAYOUT
    takes_user_evidence = False  # it is the user's evidence

    def evidence(self, save: Save) -> Evidence:
        pattern, files = save.pattern, save.files
        if pattern is not None and pattern.evidence:
            checks, ranks = [_required(files, glob) for glob in pattern.require], None
            if pattern.ranks is not None:
                regex = re.compile(re.escape(pattern.ranks).replace(re.escape("{rank}"), r"(\d+)"))
                world = _known_world(save.world_size, save.mp_world_size)
                rank_check, ranks = _rank_files(files, regex, world, name=f"ranks ({pattern.ranks})")
                checks.append(rank_check)
            return Evidence(checks, ranks)
        named = f"pattern {pattern.name!r} names" if pattern is not None else "it has"
        return Evidence([Check(EVIDENCE, PASSED, f"{named} {QUIET_ALONE}")])


FRAMEWORK = UserPattern()
