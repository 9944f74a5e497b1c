"""A real NFS export on the loopback interface, mounted twice with different attribute caches.

Runs only where the kernel has an NFS client and server and Debian's tools are installed
(`apt-get install nfs-kernel-server`, which brings nfs-common's mount.nfs), as root. Where
it cannot, the skip reason says exactly what is missing; NFS's attribute caches are then covered by
captured mountinfo lines (test_mounts.py, test_multinode.py).

On the machine this was written on it could not run: its kernel (6.18, /proc/config.gz) is
built without CONFIG_NFS_FS and CONFIG_NFSD, and without CONFIG_MODULES, so no NFS client or
server can be loaded. A userspace server (nfs-ganesha is in Debian) would export a directory,
but nothing could mount it: the client is the kernel's. So this body has never run here.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.volume.mounts import attribute_cache, mount_of, quiet_for, read_mounts
from tests.support.daemonproc import DaemonProc


def why_no_nfs() -> str | None:
    """What this machine lacks for a loopback NFS export, or None if it has it all."""
    try:
        filesystems = Path("/proc/filesystems").read_text().split()
    except OSError as exc:
        return f"cannot read /proc/filesystems: {exc}"
    missing = [fs for fs in ("nfs4", "nfsd") if fs not in filesystems]
    if missing:
        why = f"this kernel ({os.uname().release}) has no {' and no '.join(missing)} in /proc/filesystems"
        try:
            with gzip.open("/proc/config.gz") as f:
                config = f.read().decode()
            unset = [o for o in ("CONFIG_NFS_FS", "CONFIG_NFSD", "CONFIG_MODULES") if f"\n{o}=" not in config]
            if unset:
                why += f"; /proc/config.gz: {', '.join(unset)} not set"
            if "CONFIG_MODULES" in unset:
                why += " (no module can be loaded)"
        except OSError:
            pass
        return why + ": the NFS client is the kernel's, so no export can be mounted here (a userspace " \
                     "server such as nfs-ganesha could serve one, but not mount it)"
    if os.geteuid() != 0:
        return "mounting NFS needs root"
    for tool, package in (("mount.nfs", "nfs-common"), ("exportfs", "nfs-kernel-server"),
                          ("rpc.nfsd", "nfs-kernel-server")):
        if shutil.which(tool) is None:
            return f"{tool} not found: apt-get install {package}"
    return None


NO_NFS = why_no_nfs()


def sh(*args: str | os.PathLike[str]) -> None:
    subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True, timeout=60)


@pytest.fixture
def loopback_export(tmp_path):
    """One export, two client mounts: `a` with actimeo=1, `b` with the defaults (60s)."""
    export, a, b = tmp_path / "export", tmp_path / "a", tmp_path / "b"
    for d in (export, a, b):
        d.mkdir()
    if not os.path.ismount("/proc/fs/nfsd"):
        sh("mount", "-t", "nfsd", "nfsd", "/proc/fs/nfsd")
    sh("rpc.nfsd", "4")
    sh("exportfs", "-o", "rw,no_root_squash,insecure,no_subtree_check,fsid=4242", f"127.0.0.1:{export}")
    mounted = []
    try:
        for point, opts in ((a, "vers=4.2,actimeo=1"), (b, "vers=4.2")):
            sh("mount", "-t", "nfs4", "-o", opts, f"127.0.0.1:{export}", point)
            mounted.append(point)
        yield export, a, b
    finally:
        for point in mounted:
            subprocess.run(["umount", "-f", str(point)], capture_output=True, timeout=60)
        subprocess.run(["exportfs", "-u", f"127.0.0.1:{export}"], capture_output=True, timeout=60)


@pytest.mark.skipif(NO_NFS is not None, reason=f"no loopback NFS: {NO_NFS}")
def test_two_clients_with_different_caches_one_leader(loopback_export, tmp_path):
    export, a, b = loopback_export
    mounts = read_mounts()
    assert attribute_cache(mount_of(a, mounts)).max_staleness == 1
    assert attribute_cache(mount_of(b, mounts)).max_staleness == 60
    assert quiet_for(a, 0.5, mounts)[0] == 1.5 and quiet_for(b, 0.5, mounts)[0] == 60.5
    for step in (1, 2):
        hf_deepspeed_checkpoint(export / "job", step, world=2)
    configs = []
    for name, point in (("a", a), ("b", b)):
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / name}'\nlease_duration = '2s'\nlease_margin = '1s'\n"
                       f"[[roots]]\npath = '{point}'\nquiet_period = '0.5s'\nallow_short_quiet_period = true\nworld_size = 2\npoll_interval = '0.5s'\n"
                       "[roots.retention]\nkeep_last = 1\nkeep_best = 0\n")
        configs.append(cfg)
    with DaemonProc("-c", configs[0]) as first, DaemonProc("-c", configs[1]) as second:
        first.wait_message("leadership=volume (auto:")  # nfs4: the lease goes on the volume
        second.wait_message("quiet_period 0.5s is watched as 60.5s")
        first.wait_message("this ckptd deletes here (volume lease, epoch 1)")
        second.wait_message("standby, observing only")
        first.wait_message("deleted job/checkpoint-1")
    assert sorted(p.name for p in (export / "job").iterdir()) == ["checkpoint-2"]
