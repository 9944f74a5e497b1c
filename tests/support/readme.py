"""The README's test command and .ci/run's lines, as test_install.py and test_docs.py read them."""

from __future__ import annotations

import re

from tests.support.common import REPO


def readme_block_after(marker: str) -> str:
    """The first ```sh block after the paragraph that contains `marker`."""
    text = (REPO / "README.md").read_text()
    rest = text[text.index(marker):]
    m = re.search(r"```sh\n(.*?)```", rest, re.S)
    assert m, f"no sh block after {marker!r}"
    return m[1].strip()


def readme_test_command() -> str:
    return readme_block_after("Run the tests.")


def ci_lines() -> list[str]:
    return [line for line in (REPO / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
