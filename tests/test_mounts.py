"""The mount table: parsing mountinfo lines as the kernel writes them (proc(5))."""

from __future__ import annotations

from ckptd.mounts import mount_of, mounts_below, parse_mountinfo, read_mounts

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
