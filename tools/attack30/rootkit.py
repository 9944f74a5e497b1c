"""Helpers for the root tests: one real accelerate FSDP-layout checkpoint (fsdp_like.py), aged, copied per case."""
import os, shutil, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
import atk
from atk import PY, age, job, sh

_CACHE = {}


def volume(tmp_path):
    """tmp_path/vol/run/step_1: Accelerator.save_state + dcp.save of model and optimizer (the run's only
    checkpoint), aged 1 h; written once per session and copied with its mtimes."""
    if "src" not in _CACHE:
        src = Path(os.environ.get("ATK30_CACHE", "/tmp")) / f"atk30-fsdp-{os.getpid()}"
        shutil.rmtree(src, ignore_errors=True)
        job("fsdp_like.py", "save", src / "vol" / "run" / "step_1")
        age(src / "vol")
        _CACHE["src"] = src
    shutil.copytree(_CACHE["src"] / "vol", tmp_path / "vol", symlinks=True, copy_function=shutil.copy2)
    return tmp_path / "vol", tmp_path / "vol" / "run" / "step_1"


def env(tmp_path):
    e = {**atk.ENV, "HOME": str(tmp_path / "home"), "XDG_STATE_HOME": str(tmp_path / "home" / "state")}
    e.pop("CKPTD_CONFIG", None)
    return e


def intact(ck):
    return (ck / "pytorch_model_fsdp_0" / ".metadata").is_file() and (ck / "optimizer_0" / ".metadata").is_file()


def loads(ck):
    r, _ = job("fsdp_like.py", "load", ck)
    return r


def cfg(tmp_path, root, quiet="60s"):
    c = tmp_path / "c.toml"
    c.write_text(f"""
[daemon]
state_dir = "{tmp_path / 'state'}"
[[roots]]
path = "{root}"
quiet_period = "{quiet}"
[roots.retention]
keep_last = 1
keep_best = 0
""")
    return c


def ckptd(tmp_path, *args, cwd=None):
    return sh([PY, "-m", "ckptd", *map(str, args)], check=False, env=env(tmp_path), cwd=cwd)


def daemon_until(tmp_path, c, words=("deleted ", "retention:"), timeout=60):
    """Start `ckptd run --foreground -c C`; return its log once a line holds one of words (or timeout); stop it."""
    log = tmp_path / "daemon.log"
    with open(log, "w") as f:
        p = subprocess.Popen([PY, "-m", "ckptd", "run", "--foreground", "-c", str(c)], stdout=f, stderr=f,
                             stdin=subprocess.DEVNULL, env=env(tmp_path))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and p.poll() is None:
            if any(w in log.read_text() for w in words):
                break
            time.sleep(0.2)  # polling the daemon's own log for its decision, not a synchronisation sleep
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    return p.returncode, log.read_text()
