"""What a user sees from the command line: exit codes, output shapes, the first-hour traps.

Each test runs the real `ckptd` as a subprocess against the demo volume (`ckptd demo`)
or a volume written with the demo's writers (the Trainer + DeepSpeed file layout; no
framework produces a renamed checkpoint, which the one test that needs it makes with a
rename, as a user would).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.cli.demo_volume import hf_deepspeed_checkpoint
from ckptd.config import format_size
from ckptd.errors import EX_CONFIG, EX_IOERR, EX_NOINPUT, EX_USAGE
from ckptd.removal.outcome import DRY_RUN_NOTE
from tests.support.common import REPO, run_ckptd

EX_PIPE = 141


@pytest.fixture
def demo(tmp_path, state_env) -> Path:
    """`ckptd demo`: the volume and config a newcomer starts with. Returns the config."""
    proc = run_ckptd("demo", tmp_path / "demo", env=state_env)
    assert proc.returncode == 0, proc.stderr
    return tmp_path / "demo" / "ckptd.toml"


def ckptd_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_CONFIG", "NOTIFY_SOCKET")}
    env.update(extra)
    return env


# --- a closed pipe ------------------------------------------------------------


@pytest.mark.parametrize("args", [["check-config"], ["plan"], ["plan", "--json"], ["plan", "-v"]])
def test_a_reader_that_goes_away_is_not_an_io_error(demo, args):
    """`ckptd check-config | head -1`: no message, and the status a shell gives `cat` there."""
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", *args, "-c", str(demo)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ckptd_env())
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # gone before ckptd writes a byte (python takes far longer to start)
    err = proc.stderr.read()
    proc.stderr.close()
    rc = proc.wait(timeout=120)
    # check-config's verdict goes to stderr after the document: it is not reached
    assert (rc, err) == (EX_PIPE, ""), err


# --- plan ---------------------------------------------------------------------


def test_plan_json_has_the_roots_and_totals(demo):
    proc = run_ckptd("plan", "-c", demo, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    root = str(demo.parent / "experiments")
    assert doc["roots"] == [root]
    rows = doc["checkpoints"]
    assert {r["root"] for r in rows} == {root}
    actions = [r["action"] for r in rows]
    assert doc["totals"] == {
        "keep": actions.count("keep"), "delete": actions.count("delete"), "slim": actions.count("slim"),
        "bytes_to_free": sum(r["bytes_freed"] for r in rows),
    }
    assert doc["totals"]["delete"] == 3 and doc["totals"]["bytes_to_free"] > 0
    assert "checks" not in rows[0]


def test_plan_verbose_shows_each_checkpoints_evidence(demo):
    text = run_ckptd("plan", "-c", demo, "-v")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.split()[1:2] == ["checkpoint-2500"])
    evidence = []
    for line in lines[row + 1:]:
        if not line.startswith("    "):
            break
        evidence.append(line.split(None, 1))
    assert ["failed", "deepspeed shards (global_step2500)  zero_pp_rank_3_mp_rank_00_optim_states.pt missing "
            "(dp_world_size=4, mp_world_size=1 from mp_rank_00_model_states.pt)"] in evidence
    assert [verdict for verdict, _ in evidence].count("passed") >= 3
    plain = run_ckptd("plan", "-c", demo).stdout.splitlines()
    rows = [line.split()[:7] for line in lines if not line.startswith("    ")]
    assert len(lines) > len(plain) and rows == [line.split()[:7] for line in plain]
    doc = json.loads(run_ckptd("plan", "-c", demo, "--json", "-v").stdout)
    assert all(r["checks"] and {"name", "verdict", "detail"} == set(r["checks"][0]) for r in doc["checkpoints"])


# --- prune --dry-run ----------------------------------------------------------


def test_prune_dry_run_says_it_once_a_line_and_totals_the_bytes(demo):
    planned = json.loads(run_ckptd("plan", "-c", demo, "--json").stdout)["totals"]
    proc = run_ckptd("prune", "-c", demo, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(line.count(DRY_RUN_NOTE) == 1 and line.endswith(DRY_RUN_NOTE) for line in lines)
    assert not any("dry-run" in line for line in lines)  # the outcome's name said it a second time
    *actions, summary = lines
    assert len(actions) == 3 and all(line.startswith("would delete ") for line in actions)
    assert actions[0].startswith("would delete roberta-mlm/checkpoint-1000 (")
    assert summary.startswith(f"prune: 3 would be deleted ({format_size(planned['bytes_to_free'])}), "
                              "0 would be slimmed (0B of optimizer state)")


# --- --json prints a document, errors too -------------------------------------


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [(["plan", "{missing}", "--json"], EX_NOINPUT, "does not exist"),
     (["verify", "{run}", "--json"], EX_USAGE, "is a run directory"),
     (["plan", "-c", "{missing}", "--json"], EX_CONFIG, "no such file")],
)
def test_json_commands_print_a_document_when_they_fail(demo, args, code, says):
    run = demo.parent / "experiments" / "roberta-mlm"
    args = [a.format(missing=demo.parent / "missing", run=run) for a in args]
    proc = run_ckptd(*args)
    assert proc.returncode == code, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["exit_code"] == code and says in doc["error"]
    assert proc.stderr.startswith("ckptd: ") and says in proc.stderr  # and still said to a person


def test_status_json_without_a_daemon_prints_an_empty_list(tmp_path, state_env):
    proc = run_ckptd("status", "--json", env=state_env)
    assert (proc.returncode, json.loads(proc.stdout)) == (1, [])


# --- demo ---------------------------------------------------------------------


def test_demo_does_not_overwrite_without_force(tmp_path, state_env):
    base = tmp_path / "d"
    assert run_ckptd("demo", base, env=state_env).returncode == 0
    config = base / "ckptd.toml"
    config.write_text("# mine, edited\n")
    again = run_ckptd("demo", base, env=state_env)
    assert again.returncode == EX_USAGE and "--force" in again.stderr and str(config) in again.stderr
    assert config.read_text() == "# mine, edited\n"
    forced = run_ckptd("demo", base, "--force", env=state_env)
    assert forced.returncode == 0, forced.stderr
    assert config.read_text().startswith("# Written by `ckptd demo`")
    assert f"ckptd run --foreground --dry-run -c {config}" in forced.stdout  # the next step, spelt out


# --- status and health: -c, durations, roles ------------------------------------


def test_status_and_health_without_c_say_where_they_looked_and_hint_at_c(tmp_path, state_env):
    for command in ("status", "health"):
        proc = run_ckptd(command, env=state_env)
        assert proc.returncode == 1
        assert f"ckptd {command} -c CONFIG" in proc.stderr and "default state_dir" in proc.stderr
    config = tmp_path / "c.toml"
    config.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\n")
    for command in ("status", "health"):
        proc = run_ckptd(command, "-c", config, env=state_env)
        assert proc.returncode == 1 and "-c CONFIG" not in proc.stderr


def write_state(state_dir: Path, *, dry_run: bool, roots: list[dict], now: float) -> None:
    """A daemon's state file, as daemon.state() writes it; its pid is this (live) test process."""
    state_dir.mkdir(parents=True, exist_ok=True)
    doc = {"pid": os.getpid(), "version": "0.1.0", "heartbeat": now - 4, "started": now - 3725,
           "dry_run": dry_run, "counters": {"deleted": 2, "bytes_reclaimed": 3 * 2**20}, "roots": roots}
    (state_dir / f"daemon.{os.getpid()}.json").write_text(json.dumps(doc))


def root_doc(path: str, role: str | None, leader: bool) -> dict:
    ckpts = [
        {"name": "checkpoint-500", "step": 500, "state": "complete", "size_bytes": 6600, "action": "keep",
         "reasons": ["best eval_loss=0.91 (min)"]},
        {"name": "checkpoint-1000", "step": 1000, "state": "complete", "size_bytes": 6700, "action": "delete",
         "reasons": ["outside keep_last=2"]},
        {"name": "checkpoint-10000", "step": 10000, "state": "settling", "size_bytes": 123456789, "action": None,
         "reasons": []},
    ]
    doc = {"path": path, "observer": "inotify", "leader": leader, "poll_interval": 10.0,
           "oldest_incomplete_age": 312.4, "runs": [{"run": "team/roberta-mlm", "checkpoints": ckpts}]}
    if role is not None:
        doc["role"] = role
    return doc


@pytest.mark.parametrize(
    ("role", "leader", "dry_run", "shown"),
    [("leader", True, False, "leader: deletes here"),
     ("standby", False, False, "standby: another ckptd deletes here, this one observes"),
     ("dry-run", False, True, "dry run: decides, deletes nothing"),
     # a state file from before `role`: a lone dry-run daemon is not a standby
     (None, False, True, "dry run: decides, deletes nothing"),
     (None, True, False, "leader: deletes here")],
)
def test_status_shows_the_role_aligned_rows_and_readable_durations(tmp_path, role, leader, dry_run, shown):
    state = tmp_path / "state"
    write_state(state, dry_run=dry_run, roots=[root_doc("/vol", role, leader)], now=time.time())
    config = tmp_path / "c.toml"
    config.write_text(f"[daemon]\nstate_dir = '{state}'\n")
    proc = run_ckptd("status", "-c", config)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert re.fullmatch(rf"ckptd 0\.1\.0, pid {os.getpid()}(, dry run)?: up 1h2m, heartbeat \d+s ago", lines[0])
    # 312.4 s at the last write, 4 s (and the time to start ckptd) before status asked: as of now
    age = re.fullmatch(rf"  /vol: {re.escape(shown)} \(observer inotify; oldest incomplete: 5m(\d+)s\)", lines[2])
    assert age and 16 <= int(age[1]) <= 16 + 30, lines[2]
    table = lines[3:]
    assert table[0].split() == ["RUN", "CHECKPOINT", "STATE", "SIZE", "ACTION", "REASONS"]
    # every column starts where its header does
    starts = [table[0].index(h) for h in ("CHECKPOINT", "STATE", "SIZE", "ACTION", "REASONS")]
    for row in table[1:]:
        assert all(row[s - 2:s] == "  " and row[s] != " " for s in starts), (row, starts)
    assert table[3].split(None, 5)[4:] == ["-", "not decided yet (settling)"]
    assert not any(line.rstrip().endswith("-:") for line in lines)


def test_status_of_a_standby_whose_lease_holder_is_gone_says_nothing_deletes(tmp_path):
    """A volume lease naming a process of this host that has exited: not 'another ckptd deletes here'."""
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = root_doc("/vol", "standby", False)
    root["leadership"] = {"kind": "volume", "why": "test", "held": False, "epoch": 3, "released": False,
                          "holder": {"host": socket.gethostname(), "pid": dead.pid, "start": time.time() - 60,
                                     "id": "x"},
                          "expires": time.time() + 5, "since": time.time() - 60, "duration": 10.0,
                          "margin": 5.0, "waiting": "waiting for the lease to go unrenewed", "error": None}
    state = tmp_path / "state"
    write_state(state, dry_run=False, roots=[root], now=time.time())
    config = tmp_path / "c.toml"
    config.write_text(f"[daemon]\nstate_dir = '{state}'\n")
    proc = run_ckptd("status", "-c", config)
    assert proc.returncode == 0, proc.stderr
    assert f"/vol: standby: the lease's holder ({socket.gethostname()} pid {dead.pid}) is gone" in proc.stdout, \
        proc.stdout
    assert "another ckptd deletes here" not in proc.stdout


@pytest.mark.parametrize("max_age", ["-5", "0", "nan", "inf", "soon"])
def test_health_refuses_a_max_age_that_is_not_a_positive_number(tmp_path, state_env, max_age):
    proc = run_ckptd("health", "--max-age", max_age, env=state_env)
    assert proc.returncode == EX_USAGE and "--max-age" in proc.stderr


def test_the_exit_codes_are_documented_alike_in_the_docs_and_the_help():
    page = (REPO / "docs" / "reference" / "output.md").read_text()
    paragraph = page[page.index("Exit codes: 0 ok"):].split("\n\n")[0]
    help_text = run_ckptd("--help").stdout
    epilog = help_text[help_text.index("exit codes:"):help_text.index("config:")]
    for code in ("0", "1", "64", "66", "70", "74", "75", "78", "141"):
        assert re.search(rf"\b{code}\b", paragraph) and re.search(rf"\b{code}\b", epilog), code
    assert "status" in paragraph and "status" in epilog  # status exits 1 when no daemon runs


def test_a_missing_config_named_by_the_variable_says_so(tmp_path, state_env):
    missing = tmp_path / "nope.toml"
    proc = run_ckptd("plan", env={**state_env, "CKPTD_CONFIG": str(missing)})
    assert proc.returncode == EX_CONFIG
    assert proc.stderr == f"ckptd: {missing}: no such file (named by $CKPTD_CONFIG)\n"
    proc = run_ckptd("plan", "-c", missing, env=state_env)
    assert proc.stderr == f"ckptd: {missing}: no such file\n"


# --- verify ---------------------------------------------------------------------


def test_verify_on_a_run_directory_points_at_its_checkpoints(demo):
    run = demo.parent / "experiments" / "roberta-mlm"
    proc = run_ckptd("verify", run)
    assert proc.returncode == EX_USAGE  # not 1: "not complete" is about a checkpoint
    assert proc.stderr == (
        f"ckptd: {run} is a run directory holding 6 checkpoints (checkpoint-500 ... checkpoint-3000): "
        f"verify one of them, e.g. ckptd verify {run}/checkpoint-3000; ckptd plan {run} shows them all\n"
    )


def test_verify_on_a_symlink_says_it_is_not_followed(demo, tmp_path):
    link = tmp_path / "latest"
    target = demo.parent / "experiments" / "roberta-mlm" / "checkpoint-2000"
    link.symlink_to(target)
    proc = run_ckptd("verify", link)
    assert proc.returncode == EX_USAGE and "never follows symlinks" in proc.stderr and str(target) in proc.stderr


def test_verify_warns_when_a_checkpoint_holds_another_steps_files(tmp_path, state_env):
    run = tmp_path / "vol" / "job"
    old = time.time() - 3600
    hf_deepspeed_checkpoint(run, 2000, world=2, mtime=old)
    (run / "checkpoint-2000").rename(run / "checkpoint-3500")  # copied or renamed by hand
    hf_deepspeed_checkpoint(run, 4000, world=2, mtime=old)
    proc = run_ckptd("verify", run / "checkpoint-3500", env=state_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # complete: every file is there
    assert proc.stdout.splitlines()[-2:] == [
        "warning: checkpoint-3500 holds global_step2000, not global_step3500: renamed or copied?",
        "warning: checkpoint-3500's trainer_state.json says global_step=2000: renamed or copied?",
    ]
    doc = json.loads(run_ckptd("verify", run / "checkpoint-3500", "--json", env=state_env).stdout)
    assert len(doc["warnings"]) == 2
    fine = run_ckptd("verify", run / "checkpoint-4000", env=state_env)
    assert fine.returncode == 0 and "warning" not in fine.stdout


def test_step_mismatch_looks_at_trainer_checkpoints_only(tmp_path):
    from ckptd.discover.layouts import recognise
    from ckptd.judge.evidence import Inspector, RunContext, step_mismatch

    run = tmp_path / "job"
    hf_deepspeed_checkpoint(run, 20, world=1)
    (run / "checkpoint-20" / "global_step20").rename(run / "checkpoint-20" / "global_step10")
    cand = recognise("checkpoint-20", True, lambda: os.listdir(run / "checkpoint-20"))
    ckpt = Inspector(quiet_period=0).inspect(tmp_path, "job", RunContext(run, frozenset(os.listdir(run))), cand,
                                             now=time.time() + 10, world_size=1)
    assert step_mismatch(ckpt, os.listdir(run / "checkpoint-20")) == [
        "checkpoint-20 holds global_step10, not global_step20: renamed or copied?"]
    assert step_mismatch(ckpt, ["global_step20", "global_step10"]) == []  # its own tag is there
    bare = run / "global_step30"  # bare DeepSpeed: the tag is the checkpoint
    bare.mkdir()
    cand = recognise("global_step30", True, lambda: [])
    assert cand is not None and step_mismatch(
        Inspector(quiet_period=0).inspect(tmp_path, "job", RunContext(run, frozenset(os.listdir(run))), cand,
                                          now=time.time() + 10, world_size=1), []) == []


# --- check-config checks what run needs -------------------------------------------


def config_with(tmp_path: Path, roots: str, retention: str = "", state_dir: Path | None = None) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(f"[daemon]\nstate_dir = '{state_dir or tmp_path / 'state'}'\n{roots}{retention}")
    return path


@pytest.mark.parametrize(
    ("make", "code", "says"),
    [(lambda p: "", EX_USAGE, "no roots"),
     (lambda p: f"[[roots]]\npath = '{p / 'missing'}'\n", EX_NOINPUT, "does not exist"),
     (lambda p: f"[[roots]]\npath = '{p / 'a-file'}'\n", EX_NOINPUT, "is not a directory"),
     (lambda p: "[[roots]]\npath = 'relative'\n", EX_CONFIG, "must be an absolute path"),
     # a file where the state directory goes: run cannot create it, whoever runs it
     # (the root beside it: a root may not hold the state_dir, exit 78)
     (lambda p: (p / "vol").mkdir() or f"[[roots]]\npath = '{p / 'vol'}'\n", EX_IOERR, "is not a directory")],
)
def test_check_config_fails_as_run_would(tmp_path, state_env, make, code, says):
    (tmp_path / "a-file").write_text("")
    # the last case's trouble is the state directory: a file is where it would go
    state_dir = tmp_path / "a-file" / "state" if code == EX_IOERR else None
    cfg = config_with(tmp_path, make(tmp_path), state_dir=state_dir)
    checked = run_ckptd("check-config", "-c", cfg, env=state_env)
    ran = run_ckptd("run", "-c", cfg, env=state_env, timeout=60)
    assert (checked.returncode, ran.returncode) == (code, code), checked.stderr + ran.stderr
    assert says in checked.stderr and "OK" not in checked.stderr


def test_check_config_ok_says_what_it_checked(tmp_path, state_env):
    (tmp_path / "vol").mkdir()
    cfg = config_with(tmp_path, f"[[roots]]\npath = '{tmp_path / 'vol'}'\n")
    proc = run_ckptd("check-config", "-c", cfg, env={**state_env, "CKPTD_TRASH_GRACE": ""})  # conftest.py sets it
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"# {cfg}: OK (1 root(s) present)"
    assert proc.stderr.splitlines()[0].startswith(f"# roots[0] {tmp_path / 'vol'}: leadership=")
    assert json.loads(proc.stdout)["roots"][0]["path"] == str(tmp_path / "vol")


@pytest.fixture
def without_deepspeed(tmp_path) -> dict[str, str]:
    """An environment where `import deepspeed` fails, as after `pip install ckptd` without the extra."""
    site = tmp_path / "no-deepspeed"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None  # not installed\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ["PYTHONPATH"]]),
            "XDG_STATE_HOME": str(tmp_path / "xdg-state")}


def test_slimming_without_the_deepspeed_extra_is_refused_up_front(tmp_path, without_deepspeed, demo):
    volume = demo.parent / "experiments"
    cfg = config_with(tmp_path, f"[[roots]]\npath = '{volume}'\n", "[roots.retention]\nkeep_full_last = 1\n")
    for args in (["check-config"], ["prune"], ["prune", "--dry-run"], ["run", "--dry-run"]):
        proc = run_ckptd(*args, "-c", cfg, env=without_deepspeed, timeout=60)
        assert proc.returncode == EX_CONFIG, (args, proc.stdout + proc.stderr)
        assert proc.stderr.startswith("ckptd: roots[0].retention.keep_full_last: slimming needs the deepspeed "
                                      "extra, and deepspeed cannot be imported here: pip install 'ckptd[deepspeed]'")
        assert "would consolidate" not in proc.stdout
    # plan only reads: it shows the plan and says what run and prune will refuse
    plan = run_ckptd("plan", "-c", cfg, env=without_deepspeed)
    assert plan.returncode == 0, plan.stderr
    assert "(ckptd run and prune refuse this config)" in plan.stdout
    # with deepspeed importable (this machine), the same config checks out
    assert run_ckptd("check-config", "-c", cfg, env={"XDG_STATE_HOME": str(tmp_path / "x")}).returncode == 0


def test_check_config_refuses_metrics_without_prometheus_client_as_run_does(tmp_path, state_env):
    site = tmp_path / "no-prom"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['prometheus_client'] = None\n")
    env = {**state_env, "PYTHONPATH": os.pathsep.join([str(site), os.environ["PYTHONPATH"]])}
    (tmp_path / "vol").mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nstate_dir = '{tmp_path / 'state'}'\nmetrics_listen = '127.0.0.1:9'\n"
                   f"[[roots]]\npath = '{tmp_path / 'vol'}'\n")
    checked = run_ckptd("check-config", "-c", cfg, env=env)
    ran = run_ckptd("run", "-c", cfg, env=env, timeout=60)
    assert (checked.returncode, ran.returncode) == (EX_CONFIG, EX_CONFIG), checked.stderr + ran.stderr
    assert "pip install 'ckptd[metrics]'" in checked.stderr


# --- the docs' samples are the real thing --------------------------------------------


def _comparable(lines: list[str]) -> list[list[str]]:
    """Table rows without SIZE and FREES (they vary with the demo's path, which trainer_state.json
    holds) and with "last change 5.9s ago" made timeless; the summary without its byte count."""
    out = []
    for line in lines:
        cols = re.split(r"\s{2,}", line.strip(), maxsplit=8)
        if len(cols) == 9:
            cols = cols[:4] + cols[5:7] + cols[8:]
        out.append([re.sub(r"\d+(\.\d+)?s ago", "Ns ago", re.sub(r"\(\S+ to free\)", "", c)) for c in cols])
    return out


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_docs_plan_sample_is_what_the_demo_shows(demo, page):
    page = (REPO / page).read_text()
    command = "$ ckptd demo /tmp/ckptd-demo && ckptd plan -c /tmp/ckptd-demo/ckptd.toml\n"
    sample = page[page.index(command) + len(command):].split("```")[0].strip().splitlines()
    real = run_ckptd("plan", "-c", demo).stdout.strip().splitlines()
    assert _comparable(sample) == _comparable(real)


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (4.4, "4s"), (59.6, "1m0s"), (312, "5m12s"),
                                               (10813, "3h0m"), (86399, "23h59m"), (200000, "2d7h"), (-3, "0s")])
def test_elapsed_times_read_as_people_say_them(seconds, text):
    from ckptd.config import format_age

    assert format_age(seconds) == text


def test_verify_says_how_long_a_checkpoint_has_been_quiet_readably(demo):
    ckpt = demo.parent / "experiments" / "roberta-mlm" / "checkpoint-500"  # the demo wrote it "6 hours ago"
    proc = run_ckptd("verify", "-c", demo, ckpt)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [quiet] = [line.split(None, 2)[2] for line in proc.stdout.splitlines() if line.split()[1:2] == ["quiet"]]
    assert quiet == "unchanged for 6h0m (quiet_period=1m)"
