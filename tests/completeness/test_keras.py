"""Keras 3's ModelCheckpoint, on saves Keras itself wrote on the CPU (tests/support/fwkeras.py), the last one
killed inside its save (SIGKILL as the weights store closes): `.keras` archives and `.weights.h5`
files. Whole saves are complete with their metrics from the file name; the killed one is incomplete
and named why; `ckptd latest` passes over it; keep_last=1 keeps the last one Keras loads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.common import run_ckptd

pytestmark = pytest.mark.frameworks
ENV = {**os.environ, "KERAS_BACKEND": "torch", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def _fit_killed_in_epoch_3(out: Path, runs: list[str]) -> dict[str, str]:
    """Each RUN:KIND fitted by Keras in its own process (forked from one that imported keras once, which is
    most of a run's CPU time) and killed in epoch 3's save; {"RUN/file": "loads" | Keras's load error}."""
    proc = subprocess.run([sys.executable, "-m", "tests.support.fwkeras", str(out), "batch", "3", *runs], env=ENV,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(result["killed"]) == sorted(spec.split(":")[0] for spec in runs), result
    for spec in runs:  # each killed in epoch 3's save (SIGKILL), none ended by itself
        assert result["killed"][spec.split(":")[0]] == 9, (result, proc.stderr[-3000:])
        assert any(name.startswith(spec.split(":")[0] + "/") for name in result["truth"]), result
    return result["truth"]


@pytest.fixture(scope="session")
def keras_volume(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    if importlib.util.find_spec("keras") is None:
        pytest.skip("keras is not installed (the test extra installs it)")
    out = tmp_path_factory.mktemp("keras")
    truth = _fit_killed_in_epoch_3(out, ["archive:keras", "weights:weights"])
    old = os.stat(out).st_mtime - 3600
    for dirpath, dirnames, filenames in os.walk(out):
        for n in filenames + dirnames:
            st = os.stat(os.path.join(dirpath, n))
            os.utime(os.path.join(dirpath, n), (old, old + (st.st_mtime % 60)))  # an hour old, order kept
    return out, truth


def rows(tmp_path: Path, root: Path, **retention) -> tuple[Path, dict]:
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n[[roots]]\npath = '{root}'\n[roots.retention]\n"
                   + "".join(f"{k} = {json.dumps(v)}\n" for k, v in retention.items()))
    proc = run_ckptd("plan", "-c", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    return cfg, {os.path.relpath(c["path"], root): c for c in json.loads(proc.stdout)["checkpoints"]}


@pytest.mark.parametrize("run,suffix", [("archive", ".keras"), ("weights", ".weights.h5")])
def test_keras_saves_and_the_one_killed_mid_save(keras_volume, tmp_path, run, suffix):
    import shutil

    src, truth = keras_volume
    root = tmp_path / "vol"
    shutil.copytree(src / run, root / run)
    names = sorted(p.name for p in (root / run).iterdir())
    assert len(names) == 3 and all(n.endswith(suffix) for n in names)
    whole, killed = names[:2], names[2]
    assert [truth[f"{run}/{n}"] for n in whole] == ["loads", "loads"] and truth[f"{run}/{killed}"] != "loads"
    cfg, seen = rows(tmp_path, root, keep_last=1, keep_best=0)
    for n in whole:
        assert seen[f"{run}/{n}"]["layout"] == "keras" and seen[f"{run}/{n}"]["state"] == "complete"
    assert seen[f"{run}/{killed}"]["state"] == "incomplete", seen[f"{run}/{killed}"]
    assert ("not a whole zip archive" if suffix == ".keras" else "not closed") in seen[f"{run}/{killed}"]["reasons"][0]
    proc = run_ckptd("latest", root / run, env={"CKPTD_CONFIG": ""})
    assert proc.stdout == f"{root / run / whole[1]}\n", proc.stderr
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    assert sorted(p.name for p in (root / run).iterdir() if not p.name.startswith(".")) == [whole[1], killed]


def test_keras_metrics_come_from_the_file_name(keras_volume, tmp_path):
    import shutil

    src, _ = keras_volume
    root = tmp_path / "vol"
    shutil.copytree(src / "archive", root / "archive")
    _, seen = rows(tmp_path, root, keep_last=1, keep_best=1, metric="val_loss", mode="min")
    first = sorted(seen)[0]
    assert seen[first]["metric"] is not None and seen[first]["step"] == 1, seen[first]


def test_a_keras_file_without_a_named_epoch_is_never_touched(tmp_path):
    """`resnet50.keras` beside `resnet101.keras` are models, not epochs 50 and 101: not recognised."""
    from ckptd.discover import layouts

    for name in ("resnet50.keras", "model.03-0.52.keras", "best.keras", "vgg-16.weights.h5"):
        assert layouts.recognise(name, False, lambda: []) is None, name
    cand = layouts.recognise("model-epoch=03-val_loss=0.520.keras", False, lambda: [])
    assert (cand.layout, cand.step, cand.unit) == ("keras", 3, "epoch")


@pytest.fixture(scope="session")
def keras_docs_volume(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Keras's own ModelCheckpoint with the templates its docs use (fwkeras.TEMPLATES), killed in
    epoch 3's save; `docs-weights` with BackupAndRestore beside it."""
    if importlib.util.find_spec("keras") is None:
        pytest.skip("keras is not installed (the test extra installs it)")
    out = tmp_path_factory.mktemp("keras-docs")
    truth = _fit_killed_in_epoch_3(out, [f"{kind}:{kind}" for kind in ("docs-keras", "docs-metric", "docs-weights")])
    from tests.support.common import shift_mtimes

    shift_mtimes(out, 3600)  # an hour ago, order kept
    return out, truth


@pytest.mark.parametrize("run, names", [
    ("docs-keras", r"model\.0[123]-\d+\.\d\d\.keras"),
    ("docs-metric", r"epoch0[123]-val_loss\d+\.\d{3}\.keras"),
    ("docs-weights", r"w-0[123]\.weights\.h5"),
])
def test_keras_names_as_its_docs_write_them(keras_docs_volume, tmp_path, run, names):
    """`model.{epoch:02d}-{val_loss:.2f}.keras` and the others from Keras's docs were never listed
    (only an `epoch=N` field was read). The epoch is the number that varies between the saves of
    one template; the save killed in epoch 3 is incomplete; keep_last=1 keeps epoch 2, the last
    one Keras loads, and `ckptd latest` names it."""
    import re
    import shutil

    src, truth = keras_docs_volume
    root = tmp_path / "vol"
    shutil.copytree(src / run, root / run, symlinks=True)
    saved = sorted(p.name for p in (root / run).iterdir() if p.is_file())
    assert len(saved) == 3 and all(re.fullmatch(names, n) for n in saved), saved
    assert [truth[f"{run}/{n}"] for n in saved[:2]] == ["loads", "loads"] and truth[f"{run}/{saved[2]}"] != "loads"
    cfg, seen = rows(tmp_path, root, keep_last=1, keep_best=0)
    assert {n: (seen[f"{run}/{n}"]["layout"], seen[f"{run}/{n}"]["step"], seen[f"{run}/{n}"]["state"])
            for n in saved} == {saved[0]: ("keras", 1, "complete"), saved[1]: ("keras", 2, "complete"),
                                saved[2]: ("keras", 3, "incomplete")}
    assert (seen[f"{run}/{saved[0]}"]["action"], seen[f"{run}/{saved[1]}"]["action"]) == ("delete", "keep")
    assert run_ckptd("latest", root / run, env={"CKPTD_CONFIG": ""}).stdout == f"{root / run / saved[1]}\n"
    if run == "docs-metric":  # the metric's name shows before its value: val_loss9.154
        _, best = rows(tmp_path, root, keep_last=1, keep_best=1, metric="val_loss")
        assert best[f"{run}/{saved[1]}"]["metric"] == float(saved[1].split("val_loss")[1].removesuffix(".keras"))
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    assert sorted(p.name for p in (root / run).iterdir() if not p.name.startswith(".")) == (
        sorted([*saved[1:], "backup"]) if run == "docs-weights" else saved[1:])


def test_backup_and_restore_is_a_resume_copy_never_a_step(keras_docs_volume, tmp_path):
    """BackupAndRestore's `backup/latest.weights.h5` (what fit restores from): `verify` says what it
    is, `plan` counts nothing in it, and prune leaves it."""
    import shutil

    src, _ = keras_docs_volume
    root = tmp_path / "vol"
    shutil.copytree(src / "docs-weights", root / "run", symlinks=True)
    backup = root / "run" / "backup"
    assert sorted(p.name for p in backup.iterdir()) == ["latest.weights.h5", "training_metadata.json"]
    proc = run_ckptd("verify", backup / "latest.weights.h5", env={"CKPTD_CONFIG": ""})
    assert proc.returncode == 64 and "BackupAndRestore's backup" in proc.stderr, proc.stderr
    cfg, seen = rows(tmp_path, root, keep_last=1, keep_best=0)
    assert not [rel for rel in seen if rel.startswith("run/backup")]
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    assert sorted(p.name for p in backup.iterdir()) == ["latest.weights.h5", "training_metadata.json"]


def test_a_padded_template_stays_a_run_past_epoch_nine(tmp_path):
    """`w-{epoch:02d}.weights.h5` over 12 epochs (Keras's own ModelCheckpoint, whole saves): only a
    zero-padded epoch shows the names are epochs, and `w-10`, `w-11`, `w-12` show none. keep_last = 2
    had deleted w-01..w-09 (the re-check then refused w-10: no longer recognised), and after that the
    run was no run: nothing listed or pruned again, `ckptd latest` exit 1 while Keras loads w-12. The
    newest padded save is kept now, said why, and the run goes on being one."""
    import shutil

    if importlib.util.find_spec("keras") is None:
        pytest.skip("keras is not installed (the test extra installs it)")
    src = tmp_path / "made"
    proc = subprocess.run([sys.executable, "-m", "tests.support.fwkeras", str(src), "run", "docs-weights-long"],
                          env=ENV, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    truth = json.loads(proc.stdout.strip().splitlines()[-1])
    assert truth == {f"w-{e:02d}.weights.h5": "loads" for e in range(1, 13)}, truth
    from tests.support.common import shift_mtimes

    shift_mtimes(src, 3600)
    root = tmp_path / "vol"
    shutil.copytree(src / "run", root / "run")
    cfg, _ = rows(tmp_path, root, keep_last=2, keep_best=0)
    assert run_ckptd("prune", "-c", cfg).returncode == 0
    left = sorted(p.name for p in (root / "run").iterdir() if not p.name.startswith("."))
    assert left == ["w-09.weights.h5", "w-11.weights.h5", "w-12.weights.h5"], left
    _, seen = rows(tmp_path, root, keep_last=2, keep_best=0)
    assert {rel: (c["step"], c["action"]) for rel, c in seen.items()} == {
        "run/w-09.weights.h5": (9, "keep"), "run/w-11.weights.h5": (11, "keep"), "run/w-12.weights.h5": (12, "keep")}
    assert "zero-padded epoch shows" in " ".join(seen["run/w-09.weights.h5"]["reasons"])
    assert run_ckptd("latest", root / "run", env={"CKPTD_CONFIG": ""}).stdout == f"{root / 'run' / 'w-12.weights.h5'}\n"


def test_templates_of_keras_names_are_read_only_where_the_epoch_shows():
    """The light side of recognise_among: bare model names are no run, even two of a kind."""
    from ckptd.discover import layouts

    def among(*names):
        return {c.name: c.step for c in layouts.recognise_among(names)}

    assert among("model.01-0.50.keras", "model.02-0.45.keras") == {"model.01-0.50.keras": 1, "model.02-0.45.keras": 2}
    assert among("epoch1-val_loss0.5.keras", "epoch2-val_loss0.4.keras") == {
        "epoch1-val_loss0.5.keras": 1, "epoch2-val_loss0.4.keras": 2}
    assert among("model.05-0.30.keras") == {}  # one save: no template shows yet
    for pair in (("resnet50.keras", "resnet101.keras"), ("llama-7b.keras", "llama-13b.keras"),
                 ("yolo-5.keras", "yolo-8.keras"), ("m-2023.keras", "m-2024.keras"),
                 ("net-01b.keras", "net-02b.keras"), ("net01.keras", "net02.keras")):
        assert among(*pair) == {}, pair
