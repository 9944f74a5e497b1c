"""What the outside attack found beside the holes: `plan` saying plainly that a checkpoint can never
be archived; two roots refused one archive prefix; the manifest's URL in the log written with its
prefix once. The real `ckptd` as a subprocess against moto's S3 API server on 127.0.0.1."""

from __future__ import annotations

import json
import os

from tests.archive.test_archive_cli import ckptd, setup
from tests.support.s3server import s3, s3_server  # noqa: F401  (fixtures)


def test_plan_says_which_checkpoints_can_never_be_archived_and_keeps_them(tmp_path, s3):  # noqa: F811
    """Hand-made (no framework writes these into a checkpoint): a symlink, a name that is not
    UTF-8, a name with a newline."""
    root, cfg, _ = setup(tmp_path, s3, steps=(10, 20, 30, 40))
    run = root / "run"
    os.symlink("config.json", run / "checkpoint-10" / "alias.json")
    (run / "checkpoint-20" / "notes").mkdir()
    with open(os.path.join(os.fsencode(run / "checkpoint-20" / "notes"), b"caf\xe9.txt"), "wb") as f:
        f.write(b"x")
    (run / "checkpoint-30" / "two\nlines.txt").write_text("x")
    old = os.stat(run / "checkpoint-40" / "config.json").st_mtime - 60  # as old as the rest, settled
    for top, dirs, files in os.walk(os.fsencode(run)):
        for name in (top, *(os.path.join(top, n) for n in dirs + files)):
            os.utime(name, (old, old), follow_symlinks=False)
    plan = json.loads(ckptd("plan", "-c", str(cfg), "--json").stdout)
    by = {os.path.basename(c["path"]): c for c in plan["checkpoints"]}
    for name, why in (("checkpoint-10", "alias.json is a symlink"), ("checkpoint-20", "is not a UTF-8 name"),
                      ("checkpoint-30", "holds a control character")):
        assert by[name]["action"] == "keep", by[name]
        [reason] = [r for r in by[name]["reasons"] if "cannot be archived" in r]
        assert why in reason and reason.endswith("kept because required = true"), reason
    text = ckptd("plan", "-c", str(cfg)).stdout
    assert "first, verified" not in text
    ckptd("prune", "-c", str(cfg), "-q")
    assert sorted(os.listdir(run)) == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"]


def test_two_roots_under_one_archive_prefix_are_refused(tmp_path, s3):  # noqa: F811
    _, cfg, bucket = setup(tmp_path, s3)
    other = tmp_path / "vol2"
    other.mkdir()
    text = cfg.read_text()
    for url in (f"s3://{bucket}/archive", f"s3://{bucket}/archive/team", f"s3://{bucket}"):
        cfg.write_text(text + f'\n[[roots]]\npath = "{other}"\n[roots.archive]\nurl = "{url}"\n'
                       f'endpoint_url = "{s3.endpoint}"\n')
        r = ckptd("check-config", "-c", str(cfg), check=False)
        assert r.returncode == 78, (url, r.stdout, r.stderr)
        assert "roots[1].archive.url" in r.stderr and "overlaps roots[0].archive.url" in r.stderr, r.stderr
    cfg.write_text(text + f'\n[[roots]]\npath = "{other}"\n[roots.archive]\nurl = "s3://{bucket}/archive2"\n'
                   f'endpoint_url = "{s3.endpoint}"\n')
    r = ckptd("check-config", "-c", str(cfg), check=False)
    assert "archive.url" not in r.stderr, r.stderr


def test_the_log_names_the_manifest_with_its_prefix_once(tmp_path, s3):  # noqa: F811
    _, cfg, bucket = setup(tmp_path, s3)
    r = ckptd("prune", "-c", str(cfg), "-v")
    out = r.stdout + r.stderr
    assert f"archived to s3://{bucket}/archive/run/checkpoint-10.ckptd-manifest.json" in out, out
    assert "archive/archive" not in out
