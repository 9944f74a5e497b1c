"""The systemd units in systemd/: `systemd-analyze` checks them as shipped and as installed, and they
hold what the README promises.

`systemd-analyze verify` also checks that ExecStart's program exists. From a checkout,
/usr/local/bin/ckptd usually does not, and that is the one thing verify may say of the
files as shipped (the README says so). Installed, it must say nothing: the files are
checked byte for byte inside a root directory (`--root`) laid out as the README's
install steps leave a machine, not rewritten to point elsewhere.

The notify protocol itself (READY/WATCHDOG/RELOADING/STOPPING from the real daemon)
is tested in test_daemon.py.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import age
from ckptd.errors import EX_CONFIG, EX_NOINPUT, EX_USAGE
from tests.support.common import REPO

UNITS = ["ckptd.service", "ckptd@.service"]
TARGETS = ["ckptd.service", "ckptd@mnt-experiments.service"]
INSTALLED_AT = "/usr/local/bin/ckptd"
HARDENING = ["ProtectSystem", "ReadWritePaths", "ProtectHome", "PrivateTmp", "NoNewPrivileges",
             "CapabilityBoundingSet", "RestrictAddressFamilies", "IPAddressDeny", "IPAddressAllow",
             "PrivateDevices", "PrivateMounts", "ProtectProc", "ProtectKernelTunables", "ProtectKernelModules",
             "ProtectKernelLogs", "ProtectControlGroups", "ProtectClock", "ProtectHostname", "RestrictNamespaces",
             "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality", "SystemCallArchitectures", "RemoveIPC",
             "MemoryDenyWriteExecute", "SystemCallFilter", "SystemCallErrorNumber", "UMask", "MemoryMax",
             "OOMPolicy", "IOSchedulingClass", "Nice"]
SYSTEM_UNITS = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()),
                    Path("/usr/lib/systemd/system"))  # sysinit.target and friends, which verify loads

analyze = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    analyze is None, reason="systemd-analyze not installed (Debian: apt-get install systemd; .ci/run does)"
)


def directives(text: str) -> dict[str, list[str]]:
    """Key -> values, in order (a key may repeat), with the section as a prefix: 'Service.Type'."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if m := re.fullmatch(r"\[(\w+)\]", line):
            section = m[1]
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


def analyze_env() -> dict[str, str]:
    return {**os.environ, "SYSTEMD_LOG_LEVEL": "notice", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}


def run_analyze(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert analyze is not None
    return subprocess.run([analyze, *args], capture_output=True, text=True, cwd=cwd, env=analyze_env(), timeout=60)


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    """A root laid out as the README's install steps leave a machine: the units as shipped in
    /etc/systemd/system, ckptd at /usr/local/bin/ckptd, and systemd's own units and /bin/kill."""
    root = tmp_path / "root"
    units = root / "etc" / "systemd" / "system"
    units.mkdir(parents=True)
    for name in UNITS:
        shutil.copy(REPO / "systemd" / name, units / name)
    ckptd = root / INSTALLED_AT.lstrip("/")
    ckptd.parent.mkdir(parents=True)
    ckptd.write_text("#!/bin/sh\nexit 0\n")
    ckptd.chmod(0o755)
    shutil.copytree(SYSTEM_UNITS, root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    (root / "bin").mkdir()
    shutil.copy("/bin/kill", root / "bin" / "kill")
    return root


@needs_analyze
@pytest.mark.parametrize("target", TARGETS)
def test_verify_the_units_as_installed_says_nothing(installed, target):
    proc = run_analyze("verify", "--man=no", f"--root={installed}", target, cwd=installed)
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


@needs_analyze
@pytest.mark.parametrize("target", TARGETS)
def test_verify_the_units_as_shipped_says_at_most_that_ckptd_is_not_installed(target):
    """`systemd-analyze verify systemd/*.service` from a checkout, as docs/deployment/systemd.md describes it."""
    proc = run_analyze("verify", "--man=no", target, cwd=REPO / "systemd")
    said = (proc.stdout + proc.stderr).splitlines()
    if os.access(INSTALLED_AT, os.X_OK):
        assert (proc.returncode, said) == (0, [])
    else:
        assert said == [f"{target}: Command {INSTALLED_AT} is not executable: No such file or directory"]
        page = (REPO / "docs" / "deployment" / "systemd.md").read_text()
        assert f"`{INSTALLED_AT} is not executable`" in page


@needs_analyze
def test_verify_would_catch_a_mistake(installed):
    """So that a silent verify means something: a misspelt directive is reported."""
    unit = installed / "etc" / "systemd" / "system" / "ckptd.service"
    unit.write_text(unit.read_text().replace("ProtectSystem=strict", "ProtectSystm=strict"))
    proc = run_analyze("verify", "--man=no", f"--root={installed}", "ckptd.service", cwd=installed)
    assert "Unknown key" in proc.stdout + proc.stderr and "ProtectSystm" in proc.stdout + proc.stderr


def exposure(installed: Path, target: str) -> float:
    proc = run_analyze("security", "--offline=true", f"--root={installed}", "--no-pager", target, cwd=installed)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    return float(m[1])


@needs_analyze
@pytest.mark.parametrize(("name", "target"), list(zip(UNITS, TARGETS, strict=True)))
def test_security_exposure_is_the_one_the_unit_states(installed, name, target):
    """`systemd-analyze security` rated the units 5.6 MEDIUM before hardening; the figure the
    file states is the one systemd gives it (a relaxed line shows here first)."""
    score = exposure(installed, target)
    stated = re.search(r"security --offline=true \S+`: (\d+\.\d) OK", (REPO / "systemd" / name).read_text())
    assert stated and float(stated[1]) == score
    assert score <= 1.2


@pytest.mark.parametrize("name", UNITS)
def test_the_unit_holds_what_the_readme_promises(name):
    text = (REPO / "systemd" / name).read_text()
    d = directives(text)
    service = {k.removeprefix("Service."): v for k, v in d.items() if k.startswith("Service.")}
    assert service["Type"] == ["notify"] and service["NotifyAccess"] == ["main"]
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert service["WatchdogSec"] and service["Restart"] == ["on-failure"]
    # usage, a missing root, a bad config: restarting fixes none of them
    assert set(service["RestartPreventExitStatus"][0].split()) == {str(EX_USAGE), str(EX_NOINPUT), str(EX_CONFIG)}
    assert d["Unit.StartLimitBurst"] and d["Unit.StartLimitIntervalSec"]
    assert service["User"] == ["ckptd"] and service["StateDirectory"] == ["ckptd"]
    assert service["ProtectSystem"] == ["strict"] and service["ReadWritePaths"]
    assert service["NoNewPrivileges"] == ["yes"] and service["PrivateTmp"] == ["yes"]
    assert service["ProtectHome"] == ["yes"] and service["IOSchedulingClass"] == ["idle"]
    assert set(service["RestrictAddressFamilies"][0].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    # slimming's consolidation runs in the service: a memory limit, and one OOM kill is not the unit's end
    assert re.fullmatch(r"\d+[KMGT]", service["MemoryMax"][0]) and service["OOMPolicy"] == ["continue"]
    memory = text[text.index("# --- what ckptd runs"):text.index("MemoryMax=")]
    assert "python -m ckptd.removal.zero_to_fp32" in memory and "docs/slimming.md" in memory
    assert "execs nothing" not in text and "starts no helper" not in text
    [exec_start] = service["ExecStart"]
    config = "/etc/ckptd/%i.toml" if "@" in name else "/etc/ckptd/config.toml"
    assert exec_start == f"{INSTALLED_AT} run -c {config}"
    if "@" in name:  # the instance is the volume: it may write there, and waits for its mount
        assert service["ReadWritePaths"] == ["%f"] and d["Unit.RequiresMountsFor"] == ["%f"]
    assert d["Install.WantedBy"] == ["multi-user.target"]


@pytest.mark.parametrize("name", UNITS)
def test_the_unit_says_where_its_documentation_is(installed, name):
    """`Documentation=` (what `systemctl status` shows as "Docs:" and `systemctl help` opens):
    the unit itself, at the path the install steps put it (its comments explain every line), and
    the man pages of the directives it sets. URIs systemd accepts: file:, man:, http(s):, info:."""
    [docs] = directives((REPO / "systemd" / name).read_text())["Unit.Documentation"]
    uris = docs.split()
    assert all(re.fullmatch(r"(file:/\S+|man:[\w.-]+\(\d\)|https?://\S+|info:\S+)", u) for u in uris), uris
    files = [u.removeprefix("file:") for u in uris if u.startswith("file:")]
    assert files == [f"/etc/systemd/system/{name}"]
    assert all((installed / f.lstrip("/")).is_file() for f in files)  # where the install steps put it
    assert "man:systemd.exec(5)" in uris


@pytest.mark.parametrize("name", UNITS)
def test_each_hardening_line_says_why(name):
    lines = (REPO / "systemd" / name).read_text().splitlines()
    for i, line in enumerate(lines):
        key = line.partition("=")[0]
        if key == "ReadWritePaths":  # the exception to ProtectSystem=strict, under its comment
            assert lines[i - 1] == "ProtectSystem=strict", f"{name}: {line!r} is not next to ProtectSystem"
        elif key in HARDENING:
            # under a comment, directly or as one of a group of directives the comment explains
            j = i - 1
            while j >= 0 and lines[j] and not lines[j].startswith("#") and lines[j].partition("=")[0] in HARDENING:
                j -= 1
            assert j >= 0 and lines[j].startswith("#"), f"{name}: {line!r} has no comment above it"


@pytest.mark.parametrize("name", UNITS)
def test_each_exposure_left_is_explained(name):
    """What `systemd-analyze security` still counts is named, with its reason, in the unit."""
    text = (REPO / "systemd" / name).read_text()
    for setting in ("PrivateUsers=", "PrivateNetwork=", "DeviceAllow=", "ProcSubset=", "RootDirectory=",
                    "@resources", "AF_INET", "IPAddressAllow=", "UMask="):
        assert setting in text, setting


# --- MemoryDenyWriteExecute=yes and slimming ---------------------------------------------


def _mdwe_available() -> bool:
    """Linux 6.3+: prctl(PR_SET_MDWE), the kernel's own "no writable memory becomes executable"."""
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


MDWE = """
import ctypes, mmap, runpy, sys
assert ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0) == 0  # PR_SET_MDWE, REFUSE_EXEC_GAIN
try:  # the rule bites: a writable and executable mapping is refused
    mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    sys.exit("PR_SET_MDWE did not refuse a writable executable mapping")
except PermissionError:
    pass
sys.argv = ["ckptd", *sys.argv[1:]]
runpy.run_module("ckptd", run_name="__main__", alter_sys=True)
"""


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs ckptd[deepspeed]")
@pytest.mark.skipif(not _mdwe_available(), reason="needs Linux 6.3+ (prctl PR_SET_MDWE)")
def test_slimming_runs_where_writable_memory_cannot_become_executable(zero3_bf16_bare, tmp_path):
    """The units set MemoryDenyWriteExecute=yes, and slimming consolidates in a child that loads
    torch and DeepSpeed. systemd cannot run here; the kernel's same rule (PR_SET_MDWE, inherited
    by every child) is set on a real `ckptd prune` that consolidates a ZeRO-3 checkpoint."""
    assert hasattr(mmap, "PROT_EXEC")
    root = tmp_path / "vol"
    shutil.copytree(zero3_bf16_bare, root / "run")
    age(root, time.time() - 3600)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n"
                   "quiet_period = '0s'\nallow_short_quiet_period = true\n[roots.retention]\nkeep_last = 2\nkeep_best = 0\nkeep_full_last = 1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_CONFIG", "NOTIFY_SOCKET")}
    proc = subprocess.run([sys.executable, "-c", MDWE, "prune", "-c", str(cfg)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-> slimmed: consolidated global_step10 into fp32/" in proc.stdout
    assert (root / "run" / "global_step10" / "fp32" / "model.safetensors.index.json").is_file()
