"""Shared helpers for the attack tests: run ckptd's real CLI, age files, write a config."""
import json, os, subprocess, sys, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
for k in list(ENV):
    if k.startswith("CKPTD_"):
        del ENV[k]


def sh(args, timeout=600, check=True, cwd=None, env=None):
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or ENV,
                       stdin=subprocess.DEVNULL)
    if check and p.returncode != 0:
        raise RuntimeError(f"{args} -> {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def job(script, *args, timeout=600, check=True):
    """Run one of the framework scripts here in a fresh process; its last stdout line as JSON (or None)."""
    p = sh([PY, str(HERE / script), *map(str, args)], timeout=timeout, check=check)
    for l in reversed(p.stdout.strip().splitlines()):
        if l.startswith("{"):
            try:
                return json.loads(l), p
            except ValueError:
                continue
    return None, p


def age(root, seconds=3600):
    """Move every mtime under root `seconds` into the past, keeping their order."""
    now = time.time()
    for dp, dn, fn in os.walk(root):
        for n in dn + fn:
            p = os.path.join(dp, n)
            st = os.lstat(p)
            os.utime(p, (st.st_atime - seconds, st.st_mtime - seconds), follow_symlinks=False)
    st = os.stat(root)
    os.utime(root, (st.st_atime - seconds, st.st_mtime - seconds))


def config(tmp, root, keep_last=1, keep_best=0, extra_root="", extra_ret=""):
    state = Path(tmp) / "state"
    state.mkdir(parents=True, exist_ok=True)
    cfg = Path(tmp) / "ckptd.toml"
    cfg.write_text(f"""
[daemon]
state_dir = "{state}"
[[roots]]
path = "{root}"
quiet_period = "60s"
{extra_root}
[roots.retention]
keep_last = {keep_last}
keep_best = {keep_best}
{extra_ret}
""")
    return cfg


def ckptd(*args, check=False, timeout=300):
    return sh([PY, "-m", "ckptd", *map(str, args)], check=check, timeout=timeout)


def plan(cfg, *roots):
    p = ckptd("plan", "-c", cfg, "--json", *roots)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def rows(planj):
    """{checkpoint path relative to the root: row} from plan --json, whatever its exact shape."""
    out = {}
    def walk(o):
        if isinstance(o, dict):
            if "state" in o and ("path" in o or "checkpoint" in o or "name" in o):
                key = o.get("path") or o.get("checkpoint") or o.get("name")
                out[str(key)] = o
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
    walk(planj)
    return out


def verify(cfg, path):
    p = ckptd("verify", "-c", cfg, "--json", path)
    try:
        return p.returncode, json.loads(p.stdout)
    except Exception:
        return p.returncode, {"stdout": p.stdout, "stderr": p.stderr}


def latest(cfg, run):
    p = ckptd("latest", "-c", cfg, run)
    return p.returncode, p.stdout.strip(), p.stderr.strip()
