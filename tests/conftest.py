from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from tests.support import LIGHT_TEST, dsgen, threads, volcache
from tests.support.common import LOSSES, REPO
from tests.support.fwfixtures import (  # noqa: F401  (session fixtures: real framework volumes)
    accelerate_volume,
    dcp_one,
    dcp_volume,
    fw_torch_volumes,
    lightning_volume,
    orbax_volume,
    trainer_volume,
    weights_volume,
)

# Test the tree these tests sit in, not whichever copy of ckptd is installed: pyproject.toml's
# pytest `pythonpath` puts this checkout's root (its ckptd/ and tests.support) first on sys.path;
# the variable carries it to every `python -m ckptd` the tests start, wherever their working
# directory is (the helpers that start one elsewhere give it explicitly: tests.support.child_pythonpath).
# The root on it changed no import; test_two_daemons_on_one_root_only_one_deletes_and_the_other_takes_over's
# failures then were a takeover race in ckptd (docs/design/hazards.md), fixed in removal/purge.py.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
os.chdir(REPO)
# A deleted checkpoint waits daemon.trash_grace (15 minutes) in the trash before its purge: every
# test ckptd (in this process, and each `ckptd` it starts) purges at once, as before the grace
# existed, unless it says otherwise. The tests of the grace itself remove the variable
# (tests/removal/test_trash_grace.py). An explicit `trash_grace` in a test's file is overridden.
os.environ.setdefault("CKPTD_TRASH_GRACE", "0")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run the long (soak/sweep) variants")


# The tiers (pyproject.toml's markers). A test that asks for one of these fixtures, itself or through
# another, gets the marker, so a marker cannot be forgotten where a fixture says it all: the real
# DeepSpeed volumes (dsgen), the frameworks' own volumes (fwfixtures), mounts (the kernel's, bindfs,
# FUSE, NFS). Tests that start such a job themselves carry the marker explicitly; the generators
# refuse to run in a test marked neither frameworks nor deepspeed (tests.support.refuse_in_light_test).
HEAVY_FIXTURES = {
    "deepspeed": {"zero2_hf", "zero3_bf16_bare", "zero1_bf16_bare"},
    "frameworks": {"accelerate_volume", "dcp_one", "dcp_volume", "fw_torch_volumes", "lightning_volume", "orbax_volume",
                   "trainer_volume", "weights_volume"},
    "mounts": {"mount", "bindfs", "fuse", "cachefs", "loopback_export"},
}
HEAVY = ("deepspeed", "frameworks", "mounts", "slow", "network")
# The fast tier (`pytest -m fast`): the files whose tests run in this process (pure planning, the
# tracker, the reaper and the lease on real directories, the daemon's async parts) or start the CLI
# a few times at most, less any test of theirs with a heavy marker. Together they reach every module
# of ckptd/ (docs/development.md has the time and the coverage). The tests that run daemons,
# many CLI calls, framework jobs or mounts are in the default run only.
FAST_FILES = {
    "test_attest.py", "test_config.py", "test_daemon_async.py", "test_envconfig.py", "test_evidence.py",
    "test_fence.py", "test_framework_modules.py", "test_fwlayouts.py", "test_hostile.py", "test_keep_total.py",
    "test_lease.py", "test_logging.py", "test_mounts.py", "test_mutaudit_applies.py", "test_one_save.py",
    "test_plan_equivalence.py", "test_policy.py", "test_reaper.py", "test_rules.py", "test_slim.py",
    "test_slim_daemon.py", "test_slim_policy.py", "test_tracker.py", "test_verdicts.py", "test_volcache.py",
    "test_public_api.py", "test_benchmarks_md.py",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in HEAVY_FIXTURES.items():
            if used & fixtures and item.get_closest_marker(marker) is None:
                item.add_marker(marker)
        if item.path.name in FAST_FILES and not any(item.get_closest_marker(m) for m in HEAVY):
            item.add_marker("fast")
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long variant: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def alone_under_xdist(request):
    """Under pytest-xdist (the README's `-n auto`), a test marked `exclusive` changes something the
    whole machine shares (an inotify sysctl, for a moment): it takes an exclusive flock that every
    other test holds shared while it runs, so no other worker's test runs beside it. Without xdist
    (one process) there is nobody to wait for."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    mode = fcntl.LOCK_EX if request.node.get_closest_marker("exclusive") else fcntl.LOCK_SH
    with open(Path(tempfile.gettempdir()) / f"ckptd-tests-{run}.lock", "a") as lock:
        fcntl.flock(lock, mode)
        yield


@pytest.fixture(autouse=True)
def light_tests_run_no_framework(request, monkeypatch):
    """In a test marked neither frameworks nor deepspeed, a real framework or DeepSpeed job is a
    marker that lies: the generators (tests.support.refuse_in_light_test) exit saying which test."""
    if not any(request.node.get_closest_marker(m) for m in ("frameworks", "deepspeed")):
        monkeypatch.setenv(LIGHT_TEST, request.node.nodeid)


@pytest.fixture(autouse=True)
def no_thread_leaks():
    """Fail a test that leaves threads running (after watchdog's own test fixture): an observer
    not stopped, an emitter not joined (tests/daemon/test_daemon_async.py shows it failing one)."""
    before = set(threading.enumerate())
    yield
    left = threads.leaked(before)
    assert not left, f"threads leaked: {left}"


@pytest.fixture
def mount(tmp_path):
    """mount(...) args, undone at teardown. Skips where this process may not mount (not root,
    or a sandbox without CAP_SYS_ADMIN): the kernel's own mounts are the point of those tests."""
    done: list[Path] = []

    def do(*args: str | os.PathLike[str]) -> None:
        proc = subprocess.run(["mount", *map(str, args)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount here ({proc.stderr.strip() or proc.returncode}): needs root")
        done.append(Path(args[-1]))

    yield do
    for point in reversed(done):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)
    # And any mount left under tmp_path whose point was renamed meanwhile (a trash entry renamed
    # by a purge, as under a mutation of the audit): left mounted, it fails the removal of every
    # later basetemp.
    with open("/proc/self/mounts") as f:
        points = [line.split()[1].encode().decode("unicode_escape") for line in f]
    for point in sorted((p for p in points if p.startswith(f"{tmp_path}/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


@pytest.fixture
def bindfs():
    """bindfs(source, point, *options): a FUSE mount of `source` at `point` (Debian's bindfs),
    unmounted at teardown: another host's view of one volume, whose POSIX locks and flocks the
    kernel keeps apart from the source's, and whose caches the options set. Skips, saying
    which, where FUSE or bindfs is missing."""
    import shutil

    if shutil.which("bindfs") is None:
        pytest.skip("bindfs is not installed (apt-get install bindfs fuse3)")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse: FUSE mounts are not possible here")
    done: list[Path] = []

    def do(source: Path, point: Path, *options: str) -> Path:
        point.mkdir(parents=True, exist_ok=True)
        args = ["bindfs", *(["-o", ",".join(options)] if options else []), str(source), str(point)]
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount bindfs here ({proc.stderr.strip() or proc.returncode})")
        done.append(point)
        return point

    yield do
    for point in reversed(done):
        subprocess.run(["fusermount3", "-u", "-z", str(point)], capture_output=True)
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


@pytest.fixture
def state_env(tmp_path: Path) -> dict[str, str]:
    """Point the default state_dir at a directory of the test's own, beside tmp_path rather than
    in it: tests use tmp_path as a root, and a root may not hold the state_dir."""
    return {"XDG_STATE_HOME": str(tmp_path.with_name(tmp_path.name + "-xdg-state"))}


# --- real DeepSpeed volumes, generated once per session (tests/support/dsgen.py; DSGEN_NOTES.md there) ----------
# and kept across runs (tests/support/volcache.py; CKPTD_TESTS_NO_CACHE=1 generates afresh)


def _dsgen(out: Path, **kw) -> Path:
    volcache.generated("dsgen", kw, ("dsgen.py",), out, lambda out: dsgen.generate(out, **kw))
    return out


@pytest.fixture(scope="session")
def zero2_hf(tmp_path_factory) -> Path:
    """2 ranks, ZeRO-2, fp32, Trainer layout, steps 10-40 with LOSSES."""
    return _dsgen(tmp_path_factory.mktemp("zero2-hf") / "run", world_size=2, stage=2, layout="hf",
                  steps=tuple(LOSSES), eval_losses=LOSSES)


@pytest.fixture(scope="session")
def zero3_bf16_bare(tmp_path_factory) -> Path:
    """2 ranks, ZeRO-3, bf16, bare DeepSpeed layout, steps 10 and 20."""
    return _dsgen(tmp_path_factory.mktemp("zero3-bare") / "run", world_size=2, stage=3, bf16=True,
                  layout="bare", steps=(10, 20))


@pytest.fixture(scope="session")
def zero1_bf16_bare(tmp_path_factory) -> Path:
    """2 ranks, ZeRO-1, bf16 with fp32 gradient accumulation (DeepSpeed's BF16_Optimizer: per-rank
    bf16_zero_pp_rank_* shards), bare DeepSpeed layout, step 10."""
    return _dsgen(tmp_path_factory.mktemp("zero1-bf16-bare") / "run", world_size=2, stage=1, bf16=True,
                  grad_accum_fp32=True, layout="bare", steps=(10,))
