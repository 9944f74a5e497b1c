"""The mount table: parsing mountinfo lines as the kernel writes them (proc(5))."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.volume.mounts import mount_of, mounts_below, parse_mountinfo, read_mounts

# Captured shapes: the root, an NFS export with attribute-cache options, a path with a
# space (written \040 by the kernel), a bind mount inside a checkpoint, and a mount
# stacked on the same point as an earlier one (the later one hides it).
MOUNTINFO = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw,errors=remount-ro
40 22 0:52 / /mnt/exp rw,relatime shared:30 - nfs4 srv:/export rw,vers=4.2,rsize=1048576,acregmin=3,acregmax=60,actimeo=30,hard,proto=tcp
41 22 253:1 /data/my\\040dir /mnt/with\\040space rw,relatime - ext4 /dev/vda1 rw
42 22 253:1 /scratch /vol/run/checkpoint-100/extra rw,relatime - ext4 /dev/vda1 rw
43 22 0:60 / /mnt/stack rw - tmpfs tmpfs rw,size=1024k
44 22 0:61 / /mnt/stack rw,noac - nfs srv:/b rw,vers=3,noac,lookupcache=none
not a mountinfo line
"""


def test_parses_fields_options_and_escapes():
    mounts = parse_mountinfo(MOUNTINFO)
    assert [m.mount_id for m in mounts] == [22, 40, 41, 42, 43, 44]
    nfs = mounts[1]
    assert (nfs.fstype, nfs.point, nfs.source) == ("nfs4", "/mnt/exp", "srv:/export")
    assert nfs.option("actimeo") == "30" and nfs.option("acregmax") == "60"
    assert nfs.option("hard") == "" and nfs.option("noac") is None
    spaced = mounts[2]
    assert spaced.point == "/mnt/with space" and spaced.root == "/data/my dir"


def test_the_mount_holding_a_path_is_the_longest_and_the_last_stacked(tmp_path):
    mounts = parse_mountinfo(MOUNTINFO)
    assert mount_of("/mnt/exp/run1/checkpoint-5", mounts).fstype == "nfs4"
    assert mount_of("/mnt/expanded", mounts).fstype == "ext4"  # not a prefix by path component
    assert mount_of("/mnt/stack/x", mounts).fstype == "nfs"  # mounted last: it hides the tmpfs
    assert mount_of("/mnt/stack/x", mounts).option("lookupcache") == "none"


def test_mount_points_below_a_checkpoint():
    mounts = parse_mountinfo(MOUNTINFO)
    assert mounts_below("/vol/run/checkpoint-100", mounts) == ["/vol/run/checkpoint-100/extra"]
    assert mounts_below("/vol/run/checkpoint-1000", mounts) == []
    assert mounts_below("/vol/run/checkpoint-100/extra", mounts) == []  # itself is not below


def test_this_process_sees_its_own_root_mount():
    mounts = read_mounts()
    assert mounts, "no /proc/self/mountinfo"
    assert mount_of("/", mounts) is not None


# --- network filesystems' attribute caches ---------------------------------------------------
# Captured lines in the shapes the kernel writes (fs/nfs/super.c, nfs_show_mount_options): the
# ac* values appear only when they differ from nfs(5)'s defaults, `actimeo=N` shows as the four
# ac* values, `noac`/`nocto`/`nolock` as flags. This kernel has no NFS client (CONFIG_NFS_FS is
# unset and it cannot load modules), so no live NFS mount can be read here: see test_nfs.py.
NFS_MOUNTINFO = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
50 22 0:70 / /mnt/default rw,relatime shared:40 - nfs4 srv:/exp rw,vers=4.2,rsize=1048576,wsize=1048576,\
namlen=255,hard,proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.0.0.2,local_lock=none,addr=10.0.0.1
51 22 0:71 / /mnt/actimeo rw,relatime shared:41 - nfs4 srv:/exp rw,vers=4.1,rsize=1048576,wsize=1048576,\
namlen=255,acregmin=5,acregmax=5,acdirmin=5,acdirmax=5,hard,proto=tcp,local_lock=none,addr=10.0.0.1
52 22 0:72 / /mnt/noac rw,relatime shared:42 - nfs srv:/exp rw,vers=3,rsize=65536,wsize=65536,namlen=255,\
acregmin=0,acregmax=0,acdirmin=0,acdirmax=0,hard,noac,nolock,proto=tcp,local_lock=all,addr=10.0.0.1
53 22 0:73 / /mnt/dirs rw,relatime shared:43 - nfs4 srv:/exp rw,vers=4.2,acdirmax=120,hard,nocto,\
proto=tcp,lookupcache=pos,local_lock=none,addr=10.0.0.1
54 22 0:74 / /mnt/lustre rw,relatime shared:44 - lustre 10.0.0.5@tcp:/fs rw,flock,lazystatfs
55 22 0:75 / /mnt/smb rw,relatime shared:45 - cifs //srv/share rw,vers=3.1.1,cache=strict,actimeo=1
56 22 0:76 / /mnt/fuse rw,nosuid,nodev,relatime shared:46 - fuse.juicefs JuiceFS:vol rw,user_id=0
57 22 0:77 / /mnt/old rw,relatime - nfs srv:/exp rw,vers=3,actimeo=7,hard
"""


def _cache(point: str):
    from ckptd.volume.mounts import attribute_cache

    return attribute_cache(mount_of(point, parse_mountinfo(NFS_MOUNTINFO)))


def test_nfs_defaults_when_the_kernel_prints_no_ac_option():
    c = _cache("/mnt/default/run")
    assert c.max_staleness == 60 and c.close_to_open
    assert "acregmax=60s (default)" in c.detail and "acdirmax=60s (default)" in c.detail
    assert "vers=4.2" in c.detail and "lookupcache=all" in c.detail


def test_nfs_actimeo_noac_and_the_larger_of_the_two_maxima():
    assert _cache("/mnt/actimeo").max_staleness == 5  # actimeo=5 as the kernel prints it
    assert _cache("/mnt/old").max_staleness == 7  # actimeo itself (an older table, a hand-made line)
    noac = _cache("/mnt/noac")
    assert noac.max_staleness == 0 and "noac" in noac.detail
    dirs = _cache("/mnt/dirs")
    assert dirs.max_staleness == 120  # acdirmax=120 beats the default acregmax=60
    assert not dirs.close_to_open and "lookupcache=pos" in dirs.detail


def test_coherent_cifs_unknown_and_local_filesystems():
    assert _cache("/mnt/lustre").max_staleness == 0
    assert "coherent" in _cache("/mnt/lustre").detail
    assert _cache("/mnt/smb").max_staleness == 1
    assert _cache("/mnt/fuse").max_staleness is None
    assert _cache("/home").max_staleness == 0


@pytest.mark.parametrize(
    ("point", "quiet", "effective", "warns"),
    [
        ("/mnt/default", 60, 120, "watched as 120s"),  # nfs(5)'s defaults: 60s of cache, 60s quiet
        ("/mnt/actimeo", 60, 65, "watched as 65s"),
        ("/mnt/noac", 60, 60, None),
        ("/mnt/lustre", 60, 60, None),
        ("/home", 60, 60, None),
        ("/mnt/fuse", 60, 60, "used as configured"),
    ],
)
def test_the_effective_quiet_period_covers_the_cache(point, quiet, effective, warns):
    from ckptd.volume.mounts import quiet_for

    got, _, warning = quiet_for(point, quiet, parse_mountinfo(NFS_MOUNTINFO))
    assert got == effective
    assert (warning is None) if warns is None else (warns in warning)


def test_leadership_auto_is_volume_on_network_filesystems_and_refuses_nocto():
    from ckptd.fleet.lease import choose_leadership, lock_scope

    mounts = parse_mountinfo(NFS_MOUNTINFO)
    assert choose_leadership(Path("/mnt/default/x"), "auto", mounts)[::2] == ("volume", None)
    assert choose_leadership(Path("/home/x"), "auto", mounts)[::2] == ("local", None)
    assert choose_leadership(Path("/mnt/fuse/x"), "auto", mounts)[0] == "volume"
    assert choose_leadership(Path("/mnt/lustre/x"), "local", mounts)[0] == "local"
    kind, _, problem = choose_leadership(Path("/mnt/dirs/x"), "auto", mounts)
    assert kind == "volume" and "nocto" in problem
    assert lock_scope(mount_of("/mnt/default", mounts)).startswith("cluster-wide")
    assert lock_scope(mount_of("/mnt/noac", mounts)).startswith("this host only")
    assert lock_scope(mount_of("/mnt/lustre", mounts)) == "cluster-wide"
