"""The systemd units in systemd/: `systemd-analyze verify` finds nothing to say, and they hold what the README promises.

The notify protocol itself (READY/WATCHDOG/RELOADING/STOPPING from the real
daemon) is tested in test_daemon.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ckptd.errors import EX_CONFIG, EX_USAGE

from conftest import REPO

UNITS = ["ckptd.service", "ckptd@.service"]
INSTALLED_AT = "/usr/local/bin/ckptd"
HARDENING = ["ProtectSystem", "ReadWritePaths", "ProtectHome", "PrivateTmp", "NoNewPrivileges",
             "CapabilityBoundingSet", "RestrictAddressFamilies", "IOSchedulingClass", "Nice"]

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


def verify(unit_dir: Path, target: str) -> subprocess.CompletedProcess[str]:
    # --man=no: no man pages in slim images; the unit's own dir is searched for templates.
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "notice", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}
    return subprocess.run([analyze, "verify", "--man=no", target], capture_output=True, text=True,
                          cwd=unit_dir, env=env, timeout=60)


@pytest.fixture
def unit_dir(tmp_path: Path) -> Path:
    """The units with ExecStart pointing at an executable that exists here (verify checks it)."""
    stub = tmp_path / "bin" / "ckptd"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    for name in UNITS:
        text = (REPO / "systemd" / name).read_text()
        assert f"ExecStart={INSTALLED_AT} " in text
        (units / name).write_text(text.replace(INSTALLED_AT, str(stub)))
    return units


@needs_analyze
@pytest.mark.parametrize("target", ["ckptd.service", "ckptd@mnt-experiments.service"])
def test_systemd_analyze_verify_is_silent(unit_dir, target):
    proc = verify(unit_dir, str(unit_dir / target))
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


@needs_analyze
def test_verify_would_catch_a_mistake(unit_dir):
    """So that a silent verify means something: a misspelt directive is reported."""
    unit = unit_dir / "ckptd.service"
    unit.write_text(unit.read_text().replace("ProtectSystem=strict", "ProtectSystm=strict"))
    proc = verify(unit_dir, str(unit))
    assert "Unknown key" in proc.stdout + proc.stderr and "ProtectSystm" in proc.stdout + proc.stderr


@pytest.mark.parametrize("name", UNITS)
def test_the_unit_holds_what_the_readme_promises(name):
    text = (REPO / "systemd" / name).read_text()
    d = directives(text)
    service = {k.removeprefix("Service."): v for k, v in d.items() if k.startswith("Service.")}
    assert service["Type"] == ["notify"] and service["NotifyAccess"] == ["main"]
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert service["WatchdogSec"] and service["Restart"] == ["on-failure"]
    assert set(service["RestartPreventExitStatus"][0].split()) == {str(EX_USAGE), str(EX_CONFIG)}
    assert service["User"] == ["ckptd"] and service["StateDirectory"] == ["ckptd"]
    assert service["ProtectSystem"] == ["strict"] and service["ReadWritePaths"]
    assert service["NoNewPrivileges"] == ["yes"] and service["PrivateTmp"] == ["yes"]
    assert service["ProtectHome"] == ["yes"] and service["IOSchedulingClass"] == ["idle"]
    assert set(service["RestrictAddressFamilies"][0].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    [exec_start] = service["ExecStart"]
    config = "/etc/ckptd/%i.toml" if "@" in name else "/etc/ckptd/config.toml"
    assert exec_start == f"{INSTALLED_AT} run -c {config}"
    if "@" in name:  # the instance is the volume: it may write there, and waits for its mount
        assert service["ReadWritePaths"] == ["%f"] and d["Unit.RequiresMountsFor"] == ["%f"]
    assert d["Install.WantedBy"] == ["multi-user.target"]


@pytest.mark.parametrize("name", UNITS)
def test_each_hardening_line_says_why(name):
    lines = (REPO / "systemd" / name).read_text().splitlines()
    for i, line in enumerate(lines):
        key = line.partition("=")[0]
        if key == "ReadWritePaths":  # the exception to ProtectSystem=strict, under its comment
            assert lines[i - 1] == "ProtectSystem=strict", f"{name}: {line!r} is not next to ProtectSystem"
        elif key in HARDENING:
            assert lines[i - 1].startswith("#"), f"{name}: {line!r} has no comment above it"
