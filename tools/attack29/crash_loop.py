"""SIGKILL `ckptd prune` at many points, restart it, and check the promise after each round.

  python crash_loop.py MASTER_VOLUME WORK ROUNDS MAXDELAY
MASTER_VOLUME holds run dirs of real Trainer checkpoints (aged). Each round: fresh copy (cp -a),
prune killed after a random delay, `plan` checked (everything it calls complete must be byte-identical
to the original), prune again to the end, then: the keep_last newest are byte-identical, nothing outside
the root changed, no trash left. Prints one JSON line per failing round and a summary.
"""
import hashlib, json, os, random, shutil, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from atk import PY, ENV, config

master, work, rounds, maxdelay = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])


def digest(d):
    h = {}
    for dp, dn, fn in os.walk(d):
        for n in fn:
            p = os.path.join(dp, n)
            h[os.path.relpath(p, d)] = hashlib.sha1(open(p, "rb").read()).hexdigest()
    return h


orig = {}
for run in sorted(p for p in master.iterdir() if p.is_dir()):
    for c in sorted(run.iterdir()):
        if c.is_dir():
            orig[f"{run.name}/{c.name}"] = digest(c)
fails = 0
rnd = random.Random(int(os.environ.get("SEED", "1")))
for i in range(rounds):
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    vol = work / "vol"
    subprocess.run(["cp", "-a", str(master), str(vol)], check=True)
    outside = work / "outside"; outside.mkdir()
    (outside / "precious.txt").write_text("x")
    cfg = config(work, vol, keep_last=2, keep_best=0)
    delay = rnd.uniform(float(os.environ.get("MINDELAY", "0")), maxdelay)
    p = subprocess.Popen([PY, "-m", "ckptd", "prune", "-c", str(cfg), "-q"], env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    while time.monotonic() - t0 < delay and p.poll() is None:
        time.sleep(0.005)
    killed = p.poll() is None
    if killed:
        os.kill(p.pid, signal.SIGKILL)
    p.wait()
    problems = []
    pl = subprocess.run([PY, "-m", "ckptd", "plan", "-c", str(cfg), "--json", "-q"], env=ENV, capture_output=True, text=True)
    try:
        for c in json.loads(pl.stdout)["checkpoints"]:
            rel = os.path.relpath(c["path"], vol)
            if c["state"] == "complete" and digest(c["path"]) != orig.get(rel):
                problems.append(f"after kill: {rel} complete but not identical")
    except Exception as e:
        problems.append(f"plan after kill failed: {pl.returncode} {pl.stderr[-500:]}")
    q = subprocess.run([PY, "-m", "ckptd", "prune", "-c", str(cfg), "-q"], env=ENV, capture_output=True, text=True)
    if q.returncode != 0:
        problems.append(f"second prune exit {q.returncode}: {q.stderr[-400:]}")
    for run in sorted(p for p in master.iterdir() if p.is_dir()):
        names = sorted((c.name for c in run.iterdir() if c.is_dir()), key=lambda n: int(n.rsplit("-", 1)[1]))
        for n in names[-2:]:
            d = vol / run.name / n
            if not d.exists() or digest(d) != orig[f"{run.name}/{n}"]:
                problems.append(f"kept one damaged or gone: {run.name}/{n}")
        for n in names[:-2]:
            d = vol / run.name / n
            if d.exists() and digest(d) != orig[f"{run.name}/{n}"]:
                problems.append(f"half-deleted left in place: {run.name}/{n}")
    if (outside / "precious.txt").read_text() != "x":
        problems.append("outside changed")
    leftovers = [str(x) for x in vol.rglob(".ckptd-trash*") if x.is_dir() and any(x.iterdir())]
    if leftovers:
        problems.append(f"trash not purged: {leftovers}")
    if problems:
        fails += 1
        print(json.dumps({"round": i, "delay": round(delay, 3), "killed": killed, "problems": problems}), flush=True)
print(json.dumps({"rounds": rounds, "failing_rounds": fails}))
