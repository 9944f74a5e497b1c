"""SIGKILL `ckptd run` at random points while it deletes, restart it, check the promise.
  python daemon_crash_loop.py MASTER WORK ROUNDS
quiet_period 2s (allow_short_quiet_period: the checkpoints are old and nothing writes them).
"""
import hashlib, json, os, random, shutil, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from atk import PY, ENV, config

master, work, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
def digest(d):
    return {os.path.relpath(os.path.join(dp, n), d): hashlib.sha1(open(os.path.join(dp, n), "rb").read()).hexdigest()
            for dp, _, fn in os.walk(d) for n in fn}
orig = {f"{r.name}/{c.name}": digest(c) for r in master.iterdir() if r.is_dir() for c in r.iterdir() if c.is_dir()}
rnd = random.Random(int(os.environ.get("SEED", "3")))
fails = 0
def start(cfg):
    return subprocess.Popen([PY, "-m", "ckptd", "run", "--foreground", "-c", str(cfg)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
def done(vol):
    return all(len([c for c in (vol / r.name).iterdir() if c.is_dir()]) == 2 for r in master.iterdir() if r.is_dir())
for i in range(rounds):
    shutil.rmtree(work, ignore_errors=True); work.mkdir(parents=True)
    vol = work / "vol"
    subprocess.run(["cp", "-a", str(master), str(vol)], check=True)
    cfg = config(work, vol, keep_last=2, keep_best=0)
    cfg.write_text(cfg.read_text().replace('quiet_period = "60s"', 'quiet_period = "2s"\nallow_short_quiet_period = true\npoll_interval = "1s"'))
    p = start(cfg)
    delay = rnd.uniform(2.0, 3.2)
    t0 = time.monotonic()
    while time.monotonic() - t0 < delay:
        time.sleep(0.005)
    os.kill(p.pid, signal.SIGKILL); p.wait()
    problems = []
    pl = subprocess.run([PY, "-m", "ckptd", "plan", "-c", str(cfg), "--json", "-q"], env=ENV, capture_output=True, text=True)
    for c in json.loads(pl.stdout)["checkpoints"]:
        rel = os.path.relpath(c["path"], vol)
        if c["state"] == "complete" and digest(c["path"]) != orig.get(rel):
            problems.append(f"after kill: {rel} complete but not identical")
    p = start(cfg)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30 and not (done(vol) and not any(x.is_dir() and any(x.iterdir()) for x in vol.glob(".ckptd-trash*"))):
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGTERM); p.wait()
    for r in master.iterdir():
        if not r.is_dir():
            continue
        names = sorted((c.name for c in r.iterdir() if c.is_dir()), key=lambda n: int(n.rsplit("-", 1)[1]))
        for n in names[-2:]:
            d = vol / r.name / n
            if not d.exists() or digest(d) != orig[f"{r.name}/{n}"]:
                problems.append(f"kept one damaged or gone: {r.name}/{n}")
        for n in names[:-2]:
            if (vol / r.name / n).exists():
                problems.append(f"not deleted after restart: {r.name}/{n}")
    left = [str(x) for x in vol.glob(".ckptd-trash*") if x.is_dir() and any(x.iterdir())]
    if left:
        problems.append(f"trash not purged: {left}")
    if problems:
        fails += 1
        print(json.dumps({"round": i, "delay": round(delay, 3), "problems": problems}), flush=True)
print(json.dumps({"rounds": rounds, "failing_rounds": fails}))
