"""The first daemon run, as a newcomer does it: `ckptd demo`, then `ckptd run --foreground --dry-run`.

At the default level the log says at once what the daemon waits for and when it first
decides, shows a dry-run daemon as dry-run (not standby), and then holds state changes
and decisions when they change: no heartbeat lines, no keep line per checkpoint per pass.
The demo's quiet_period is shortened from 60 s to 1 s so that the test waits one second,
not a minute; nothing else differs from what the README tells a newcomer to run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from ckptd.config import format_size
from tests.support.common import REPO, run_ckptd
from tests.support.daemonproc import DaemonProc, write_config

SIMTRAIN = REPO / "tests" / "support" / "simtrain.py"
TEXT_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}[+-]\d{4}) (DEBUG|INFO|WARNING|ERROR) (.*)")
CHECKPOINTS = 10  # in the demo: 6 Trainer + DeepSpeed, 4 Megatron


def demo(tmp_path: Path, state_env: dict[str, str], quiet: str = "1s") -> Path:
    proc = run_ckptd("demo", tmp_path / "demo", env=state_env)
    assert proc.returncode == 0, proc.stderr
    config = tmp_path / "demo" / "ckptd.toml"
    text = config.read_text()
    assert 'quiet_period = "60s"' in text
    config.write_text(text.replace('quiet_period = "60s"', f'quiet_period = "{quiet}"\nallow_short_quiet_period = true'))
    return config


def text_daemon(*args: str | Path, env: dict[str, str]) -> DaemonProc:
    """`ckptd run --foreground ...` exactly: text lines, the default level."""
    return DaemonProc(*args, env=env, command=[sys.executable, "-m", "ckptd", "run", "--foreground"])


def messages(daemon: DaemonProc) -> list[tuple[str, str]]:
    """(level, message) of each text line; every line must be one."""
    out = []
    for line in daemon.lines:
        m = TEXT_LINE.fullmatch(line["message"])
        assert m, f"not a log line with a time and its UTC offset: {line['message']!r}"
        out.append((m[2], m[3]))
    return out


def test_the_first_run_says_what_it_waits_for_then_decides_once(tmp_path, state_env):
    config = demo(tmp_path, state_env)
    with text_daemon("--dry-run", "-c", config, env=state_env) as daemon:
        daemon.wait_message("ready: ", timeout=60)
        daemon.wait_message("meanwhile, by file times")
        # every checkpoint has settled (8 complete, 2 incomplete) and is decided: the totals say so
        daemon.wait_for(lambda line: " INFO retention: " in line["message"], timeout=60)
        status = run_ckptd("status", "-c", config, env=state_env)
        state = json.loads(run_ckptd("status", "-c", config, "--json", env=state_env).stdout)
    said = messages(daemon)
    text = [m for _, m in said]
    start = text.index(next(m for m in text if m.startswith("ready: ")))
    # before anything else: who, from which config, dry run, the root's role, what was found
    assert text[0].startswith(f"ckptd 0.1.0 starting (pid {daemon.proc.pid}), config {config} (dry run;")
    root = config.parent / "experiments"
    assert f"{root}: dry run: deciding, deleting nothing (no lock taken)" in text[:start]
    assert f"{root}: 10 checkpoint(s) in 2 run(s)" in text[:start]
    ready = text[start]
    assert re.fullmatch(
        r"ready: watching 1 root\(s\), 10 checkpoint\(s\) settling: ckptd decides about a checkpoint once it has "
        r"itself seen it unchanged for quiet_period \(1s; file times are not trusted\)\. First decisions at "
        r"\d\d:\d\d:\d\d \(in [01]s\); dry run: nothing will be deleted", ready), ready
    doomed = ("roberta-mlm/checkpoint-1000", "team-a/gpt-small/iter_0001000", "team-a/gpt-small/iter_0002000")
    blocks = sum(p.lstat().st_blocks * 512 for d in doomed for p in (root / d, *(root / d).rglob("*")))
    assert text[start + 1] == (
        "meanwhile, by file times (as `ckptd plan` shows it now): 8 complete, 2 incomplete; "
        f"would delete 3 ({format_size(blocks)}: {', '.join(doomed)})")  # as the disk counts it
    # the default level: no debug lines, no heartbeat lines
    assert {level for level, _ in said} == {"INFO"}
    assert not any("state written" in m for m in text)
    # found at start: no line per complete or kept checkpoint, one totals line; each incomplete
    # one's state and each deletion once, in path order
    states = [m.split(":")[0] for m in text if re.fullmatch(r"\S+: (complete|incomplete).*", m)]
    assert len(states) == len(set(states)) == CHECKPOINTS - 8
    assert not any(re.fullmatch(r"\S+: complete.*", m) for m in text)
    decided = [m.split()[2].rstrip(":") for m in text if m.startswith("decide ")]
    assert len(decided) == len(set(decided)) == 3
    assert [m for m in text if m.startswith("retention: ")] == [
        "retention: 5 kept, would delete 3, would slim 0, 2 incomplete or in flight (2 runs) "
        "(dry run; not actually removing anything)"]
    deletes = [m for m in text if m.startswith("decide delete ")]
    assert [m.split()[2] for m in deletes] == ["roberta-mlm/checkpoint-1000:", "team-a/gpt-small/iter_0001000:",
                                              "team-a/gpt-small/iter_0002000:"]
    assert all(m.endswith("(dry run; not actually removing anything)") for m in deletes)
    # incomplete checkpoints get their state line, not a keep line too
    assert not any(m.startswith("decide keep roberta-mlm/checkpoint-2500") for m in text)
    # a lone dry-run daemon is a dry-run daemon, not a standby
    [r] = state[0]["roots"]
    assert (r["role"], r["leader"], state[0]["dry_run"]) == ("dry-run", False, True)
    assert f"  {root}: dry run: decides, deletes nothing" in status.stdout


def test_passes_after_the_first_say_nothing_new(tmp_path, state_env):
    """Reconciles every 0.3 s re-decide everything: the log says only what changed (nothing)."""
    config = demo(tmp_path, state_env, quiet="0.5s")
    text = config.read_text().replace('quiet_period = "0.5s"',
                                      'quiet_period = "0.5s"\npoll_interval = "0.1s"\nreconcile_interval = "0.3s"')
    config.write_text(text)
    # -v and JSON: the debug lines show the passes; the info lines are what the default level shows
    with DaemonProc("-c", config, "--dry-run", env=state_env) as daemon:
        daemon.wait_for(lambda line: line["level"] == "info" and line["message"].startswith("retention: "),
                        timeout=60)  # the totals, once every checkpoint found has settled
        mark = daemon.mark()
        daemon.wait_message("state written", start=mark, count=3)  # >= 2 s later: >= 6 reconciles
        lines = daemon.lines[:]
    assert [line["message"] for line in lines[mark:] if line["level"] == "info"] == []
    info = [line for line in lines if line["level"] == "info"]
    # the JSON lines: UTC times, the root on per-root lines
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"]) for line in lines)
    root = str(config.parent / "experiments")
    decisions = [line for line in info if line["message"].startswith("decide ")]
    assert decisions and all(line["root"] == root and line["dry_run"] is True for line in decisions)
    assert all(line["root"] == root for line in info if line.get("state") in ("complete", "incomplete"))


def test_a_checkpoint_being_written_is_said_when_it_appears_and_when_it_completes(tmp_path, state_env):
    """A save in chunks flips writing <-> settling at every pause: debug lines, not info lines."""
    root = tmp_path / "vol"
    (root / "job").mkdir(parents=True)
    cfg = write_config(tmp_path / "c.toml", root, tmp_path / "state",
                       root_extra="quiet_period = '0.4s'\nallow_short_quiet_period = true\nworld_size = 2", retention="keep_last = 1\nkeep_best = 0")
    with DaemonProc("-c", cfg, env=state_env) as daemon:
        daemon.wait_message("ready")
        job = subprocess.run([sys.executable, str(SIMTRAIN), str(root / "job"), "--world", "2", "--steps", "10",
                              "--chunks", "12", "--chunk-pause", "0.1"], capture_output=True, text=True, timeout=120)
        assert job.returncode == 0 and json.loads(job.stdout)["violations"] == []
        daemon.wait_for(lambda line: line.get("checkpoint") == "checkpoint-10" and line.get("state") == "complete"
                        and line["level"] == "info")
        lines = daemon.lines[:]
    mine = [line for line in lines if line.get("checkpoint") == "checkpoint-10" and "state" in line]
    flips = [line for line in mine if line["level"] == "debug"]
    said = [line["message"] for line in mine if line["level"] == "info"]
    assert len(flips) > len(said)  # the tracker's transitions, every one of them
    assert said[0] in ("job/checkpoint-10: new, writing", "job/checkpoint-10: new, settling")
    assert said[-1].startswith("job/checkpoint-10: complete (hf, ")
    assert not any("writing again" in m or "settling again" in m for m in said[1:-1]), said
