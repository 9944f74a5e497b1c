"""Every mutation of the audit still names its line: a protection moved or reworded without its
mutation following would leave the audit testing nothing there (it reports such an edit only when
it is run, 50 minutes)."""

from __future__ import annotations

import importlib.util

from tests.support.common import REPO


def _muts():
    spec = importlib.util.spec_from_file_location("muts", REPO / "tools" / "mutaudit" / "muts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MUTS


def test_every_mutation_names_exactly_one_place():
    stale = []
    for mut in _muts():
        for file, old, _ in mut["edits"]:
            path = REPO / file if file.startswith(("tests/", "bench/")) else REPO / "ckptd" / file
            count = path.read_text().count(old) if path.exists() else -1
            if count != 1:
                stale.append(f"{mut['id']}: {file}: found {count} times")
    assert not stale, "\n".join(stale)


def test_every_mutation_has_an_id_of_its_own():
    """Ids name mutations in the audit's report, in commits and in closing notes: two branches
    that each add one under the same id (it happened twice) make every one of those ambiguous."""
    seen: dict[str, int] = {}
    for mut in _muts():
        seen[mut["id"]] = seen.get(mut["id"], 0) + 1
    assert [i for i, n in seen.items() if n > 1] == []
