"""The cache of generated volumes (tests/support/volcache.py): a second run gets a private copy as
old, file by file, as a fresh one; a changed generator or package is a miss; the opt-out stores
nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.support import volcache


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    where = tmp_path / "cache"
    monkeypatch.setenv("CKPTD_TESTS_CACHE", str(where))
    monkeypatch.delenv("CKPTD_TESTS_NO_CACHE", raising=False)
    return where


def make_counting(calls: list[Path]):
    def make(out: Path) -> dict:
        calls.append(out)
        (out / "run" / "step-1").mkdir(parents=True)
        (out / "run" / "step-1" / "weights").write_bytes(b"w" * 64)
        os.symlink("step-1", out / "run" / "last")
        os.utime(out / "run" / "step-1" / "weights", (time.time() - 100, time.time() - 100))
        return {"out_dir": out, "paths": [out / "run" / "step-1"], "text": str(out / "run"), "n": 1}
    return make


def test_a_second_run_copies_what_the_first_wrote_rebased_and_as_old(cache, tmp_path):
    calls: list[Path] = []
    first = volcache.generated("t", {"a": 1}, ("volcache.py",), tmp_path / "one", make_counting(calls))
    assert calls == [(tmp_path / "one").resolve()]
    weights = tmp_path / "one" / "run" / "step-1" / "weights"
    age_first = time.time() - weights.stat().st_mtime

    second = volcache.generated("t", {"a": 1}, ("volcache.py",), tmp_path / "two", make_counting(calls))
    assert len(calls) == 1, "the cached volume was generated again"
    two = (tmp_path / "two").resolve()
    assert second == {"out_dir": two, "paths": [two / "run" / "step-1"], "text": str(two / "run"), "n": 1}
    assert isinstance(second["out_dir"], Path) and first["out_dir"] != second["out_dir"]
    copied = two / "run" / "step-1" / "weights"
    assert copied.read_bytes() == b"w" * 64
    assert os.readlink(two / "run" / "last") == "step-1"
    # as old as the fresh one was, within the test's own run time
    assert abs((time.time() - copied.stat().st_mtime) - age_first) < 5
    # a private copy: changing it leaves the cache as it was
    copied.write_bytes(b"changed")
    third = volcache.generated("t", {"a": 1}, ("volcache.py",), tmp_path / "three", make_counting(calls))
    assert (third["out_dir"] / "run" / "step-1" / "weights").read_bytes() == b"w" * 64


def test_other_arguments_sources_or_versions_are_other_keys(monkeypatch):
    base = volcache.key("t", {"a": 1}, ("volcache.py",))
    assert base == volcache.key("t", {"a": 1}, ("volcache.py",))
    assert base != volcache.key("t", {"a": 2}, ("volcache.py",))
    assert base != volcache.key("t", {"a": 1}, ("volcache.py", "fwgen.py"))
    monkeypatch.setattr(volcache, "_version", lambda dist: "9.9" if dist == "torch" else "-")
    assert base != volcache.key("t", {"a": 1}, ("volcache.py",))


def test_the_opt_out_generates_every_time_and_stores_nothing(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTD_TESTS_NO_CACHE", "1")
    calls: list[Path] = []
    volcache.generated("t", {}, ("volcache.py",), tmp_path / "one", make_counting(calls))
    volcache.generated("t", {}, ("volcache.py",), tmp_path / "two", make_counting(calls))
    assert len(calls) == 2 and not cache.exists()
