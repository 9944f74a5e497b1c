"""Consolidating a real ZeRO-2 checkpoint's fp32 weights: peak memory and time, ckptd vs the baselines.

`python -m bench.consolidation` (minutes; not part of `python -m bench` nor of the tests' default run,
whose smoke test runs `--quick` on a tiny checkpoint): a real DeepSpeed job (tests/support/dsgen.py: 2 ranks,
ZeRO-2, bf16, on the CPU) trains an MLP of ~300M parameters (1.1 GiB of fp32 master weights) for one
step and saves it, once: the checkpoint is cached under `--cache` (default
`$XDG_CACHE_HOME/ckptd-bench/consolidation`), so reruns skip the generation (minutes, ~8 GiB of RAM).

Each consolidation runs as a child process; its peak RSS is the kernel's high-water mark for it
(`wait4`'s `ru_maxrss`), its time the wall clock around it. Medians of `--reps` runs, interleaved:
- baseline: zero_to_fp32 as ckptd ran it before: the whole fp32 state dict (`lazy_mode=False`), one
  `safetensors.torch.save_file`, read back and compared, hashed;
- DeepSpeed's own `convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=True)`, what a user
  would run (`zero_to_fp32.py`): lazy mode and 5GB shards (no read-back);
- ckptd: `python -m ckptd.removal.zero_to_fp32` (lazy; ZeRO-2's merge unmaterialised; shards streamed one
  tensor at a time, each read back through safetensors and compared), dropping the shards' mappings
  every 128 MiB (its default) and every 1 GiB: the memory above the floor follows that, not the model.
`--shape wide` puts nearly all the weights in one tensor of 1 GiB: what the largest tensor costs.
The floor is `python -c "import torch, deepspeed, safetensors"`: what any of them holds before reading.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO

# (hidden, layers): Linear(16, h), `layers` × Linear(h, h), Linear(h, 8)
SHAPES = {
    "mlp": (4096, 18),  # 302M parameters: 1.13 GiB fp32, the largest tensor 64 MiB
    "wide": (16384, 1),  # 269M parameters, nearly all in one tensor of 1 GiB: what the largest costs
    "quick": (256, 2),
}

BASELINE = r"""
import contextlib, hashlib, json, os, sys, torch
from safetensors import safe_open
from safetensors.torch import save_file
from deepspeed.utils import zero_to_fp32
save_dir, tag, out = sys.argv[1:4]
with contextlib.redirect_stdout(sys.stderr):
    sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
seen, untied = set(), {}
for name, t in sd.items():  # save_file refuses tensors that share storage: ZeRO-2's are views of one vector
    ptr = t.untyped_storage().data_ptr()
    untied[name] = t.clone() if ptr in seen else t
    seen.add(ptr)
save_file(untied, out, metadata={"format": "pt"})
with safe_open(out, framework="pt") as f:
    for name in f.keys():
        a, b = f.get_tensor(name), sd[name]
        bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(bits(a), bits(b)), name
h = hashlib.sha256()
with open(out, "rb") as f:
    while chunk := f.read(1 << 20):
        h.update(chunk)
print(json.dumps({"bytes": os.stat(out).st_size}))
"""

DEEPSPEED = r"""
import contextlib, json, os, sys
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
save_dir, tag, out = sys.argv[1:4]
with contextlib.redirect_stdout(sys.stderr):
    convert_zero_checkpoint_to_fp32_state_dict(save_dir, out, safe_serialization=True, tag=tag)
print(json.dumps({"bytes": sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))}))
"""

FLOOR = "import torch, deepspeed, safetensors"  # what every variant imports before reading anything


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "CKPTD_CONFIG"}
    e.update(DS_ACCELERATOR="cpu", TQDM_DISABLE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), e.get("PYTHONPATH")]))
    return e


def measure(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS in bytes) of a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}):\n{err[-3000:]}")
    return wall, usage.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def _generated(cache: Path, shape: tuple[int, int]) -> tuple[Path, Path]:
    """(where the checkpoint of `shape` is generated, the file that says it was)."""
    hidden, layers = shape
    where = cache / f"zero2-bf16-2ranks-h{hidden}-l{layers}"
    return where, where / "generated.json"


def generate(cache: Path, shape: tuple[int, int]) -> Path:
    """The real ZeRO-2 checkpoint (bare layout: <run>/global_step1/), generated once into `cache`."""
    hidden, layers = shape
    where, done = _generated(cache, shape)
    if done.exists():
        return where / "run"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    print(f"generating a real ZeRO-2 checkpoint in {where} (once)...", file=sys.stderr, flush=True)
    from tests.support import dsgen

    t0 = time.perf_counter()
    info = dsgen.generate(where / "run", world_size=2, stage=2, bf16=True, layout="bare", steps=(1,),
                          hidden=hidden, layers=layers, timeout=3600)  # fmt: skip
    took = time.perf_counter() - t0
    done.write_text(json.dumps({"seconds": took, "files": info["checkpoints"][1]["files"]}))
    return where / "run"


def fmt_size(n: float) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        scale = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}[unit]
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def run(save_dir: Path, tag: str, reps: int, work: Path) -> list[dict]:
    """Every variant `reps` times, interleaved; the median wall time and peak RSS of each."""
    model_states = save_dir / tag / "mp_rank_00_model_states.pt"
    py = sys.executable

    def ckptd(*options: str):
        def cmd(out: Path) -> list[str]:
            out.mkdir()
            return [py, "-m", "ckptd.removal.zero_to_fp32", str(save_dir), tag, str(model_states), str(out),
                    "--source-fingerprint", "bench", *options]  # fmt: skip

        return cmd

    variants = {
        "floor: python importing torch, deepspeed, safetensors": lambda out: [py, "-c", FLOOR],
        "baseline: zero_to_fp32 eager + save_file + read-back (ckptd before)": lambda out: [
            py, "-c", BASELINE, str(save_dir), tag, str(out)],
        "DeepSpeed's convert_zero_checkpoint_to_fp32_state_dict (lazy_mode, 5GB shards)": lambda out: [
            py, "-c", DEEPSPEED, str(save_dir), tag, str(out)],
        "ckptd: lazy, streamed, read back + compared; mappings dropped every 128 MiB (default)": ckptd(),
        "ckptd: the same, mappings dropped every 1 GiB": ckptd("--remap-bytes", str(1 << 30)),
    }  # fmt: skip
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in variants}
    for i in range(reps):
        for name, cmd in variants.items():
            out = work / f"out-{i}-{len(samples[name])}-{abs(hash(name))}"
            samples[name].append(measure(cmd(out)))
            if out.is_dir():
                shutil.rmtree(out)
            elif out.exists():
                out.unlink()
            wall, rss = samples[name][-1]
            print(f"  {name}: {wall:.1f} s, {fmt_size(rss)}", file=sys.stderr)
    rows = []
    for name, s in samples.items():
        wall, rss = statistics.median(w for w, _ in s), statistics.median(r for _, r in s)
        rows.append({"variant": name, "runs": len(s), "wall_s": wall, "peak_rss": rss})
    return rows


def table(rows: list[dict], fp32_bytes: int, largest: int) -> str:
    base = next(r for r in rows if r["variant"].startswith("baseline"))
    floor = next(r for r in rows if r["variant"].startswith("floor"))
    what = f"consolidating {fmt_size(fp32_bytes)} of fp32 weights (largest tensor {fmt_size(largest)})"
    lines = [
        f"| {what}, median of {base['runs']} | wall | peak RSS | above the floor | RSS ratio | wall ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        above = fmt_size(r["peak_rss"] - floor["peak_rss"]) if r is not floor else "—"
        ratios = f"{r['peak_rss'] / base['peak_rss']:.2f}× | {r['wall_s'] / base['wall_s']:.2f}×"
        cells = (r["variant"], f"{r['wall_s']:.1f} s", fmt_size(r["peak_rss"]), above, ratios)
        lines.append(f"| {' | '.join(cells)} |")
    lines.append("\n(ratios against the baseline, in the same run)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.consolidation", description=__doc__.splitlines()[0])
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    p.add_argument("--cache", type=Path, default=xdg / "ckptd-bench" / "consolidation",
                   help="where the generated checkpoint is kept between runs")  # fmt: skip
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 run each: the smoke test")
    p.add_argument("--shape", choices=("mlp", "wide"), default="mlp", help="the model (see SHAPES)")
    p.add_argument("--checkpoint", type=Path, help="a bare ZeRO-2 run directory (global_step*/) instead")
    args = p.parse_args(argv)
    save_dir = args.checkpoint or generate(args.cache, SHAPES["quick" if args.quick else args.shape])
    tag = sorted(d.name for d in save_dir.glob("global_step*"))[-1]
    sys.path.insert(0, str(SRC))
    from ckptd.frameworks import dsmeta

    shapes = dsmeta.expected_tensors(save_dir / tag / "mp_rank_00_model_states.pt")
    sizes = [4 * __import__("math").prod(s) for s in shapes.values()]
    print(f"checkpoint {save_dir / tag}: {len(sizes)} tensors, {fmt_size(sum(sizes))} fp32", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-consolidation-", dir=save_dir.parent) as work:
        rows = run(save_dir, tag, 1 if args.quick else args.reps, Path(work))
    print(table(rows, sum(sizes), max(sizes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# --- in `python -m bench --consolidation`: the same measurement as rows of BENCHMARKS.md ---------------

NAME = "12. consolidation"
OVERHEAD = 1 << 29  # the bound besides twice the largest tensor: 2 × 128 MiB of mappings, and slack


def bench(ctx) -> tuple[list, object]:  # (Context) -> (rows, Section); bench.* imported lazily
    """Consolidating a real ZeRO-2 checkpoint with ≥ 1 GiB of fp32 weights: ckptd's
    peak RSS above the floor within twice the largest tensor plus `OVERHEAD`, against eager
    zero_to_fp32 (ckptd before) and DeepSpeed's own converter, interleaved in the same run."""
    from bench.measure import fmt_time
    from bench.report import Row, Section

    shape = SHAPES["quick" if ctx.quick else "mlp"]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckptd-bench" / "consolidation"
    ctx.log("consolidation: the real ZeRO-2 checkpoint (generated once, cached)")
    cached = _generated(cache, shape)[1].exists()
    t0 = time.perf_counter()
    save_dir = generate(cache, shape)
    generated = time.perf_counter() - t0
    tag = sorted(d.name for d in save_dir.glob("global_step*"))[-1]
    shapes = (  # in a child: the harness hides torch from itself
        "import json, math, sys\nfrom ckptd.frameworks import dsmeta\n"
        "print(json.dumps([4 * math.prod(s) for s in dsmeta.expected_tensors(sys.argv[1]).values()]))"
    )
    states = str(save_dir / tag / "mp_rank_00_model_states.pt")
    sizes = json.loads(subprocess.run([sys.executable, "-c", shapes, states], env=env(), capture_output=True,
                                      text=True, check=True).stdout)  # fmt: skip
    fp32, largest = sum(sizes), max(sizes)
    reps = 1 if ctx.quick else 3
    ctx.log(f"consolidation: {fmt_size(fp32)} of fp32 weights, {reps} × each variant")
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-consolidation-", dir=save_dir.parent) as work:
        rows = run(save_dir, tag, reps, Path(work))
    def variant(*words: str) -> dict:
        return next(r for r in rows if all(w in r["variant"] for w in words))

    floor, base, ds = variant("floor:"), variant("baseline:"), variant("DeepSpeed's")
    ours = variant("ckptd:", "(default)")
    bound = 2 * largest + OVERHEAD
    above = ours["peak_rss"] - floor["peak_rss"]
    case = f"{fmt_size(fp32)} fp32 in {len(sizes)} tensors (largest {fmt_size(largest)})"

    def versus_eager(what: str, key: str, fmt: Callable[[float], str]) -> Row:
        return Row(NAME, f"{case}: {what}, ckptd vs eager zero_to_fp32 (ckptd before)", fmt(ours[key]),
                   fmt(base[key]), f"{ours[key] / base[key]:.2f}×")  # fmt: skip

    out = [
        versus_eager("peak RSS", "peak_rss", fmt_size),
        Row(
            NAME,
            f"{case}: peak RSS above the floor (`import torch, deepspeed, safetensors`)",
            fmt_size(above),
            "—",
            "—",
            f"≤ 2 × largest + {fmt_size(OVERHEAD)} ({fmt_size(bound)})",
            above <= bound,
            "" if above <= bound else f"{fmt_size(above)} above the floor against {fmt_size(bound)}",
        ),
        versus_eager("wall time", "wall_s", fmt_time),
    ]
    section = Section(
        NAME,
        "`python -m bench --consolidation` (opt-in: minutes and ~8 GiB to write the checkpoint once; "
        "the same measurement as `python -m bench.consolidation`): a real 2-rank ZeRO-2 bf16 job on the CPU "
        "(tests/support/dsgen.py) saves an MLP once, cached under ~/.cache/ckptd-bench/consolidation; each "
        "variant consolidates it in a child process, interleaved, peak RSS from `wait4`. Target: "
        "ckptd's peak above the floor within twice the largest tensor (a parameter split across "
        f"ranks is written and compared piece by piece) plus {fmt_size(OVERHEAD)} (its mappings, dropped "
        "every 128 MiB, and slack), whatever the model's size.",
        [
            f"the checkpoint: {save_dir / tag}, {fmt_size(fp32)} of fp32 master weights in {len(sizes)} "
            f"tensors, the largest {fmt_size(largest)} ({'cached' if cached else 'generated'}, "
            f"{generated:.0f} s)",
            *(
                f"{r['variant']}: {r['wall_s']:.1f} s, peak {fmt_size(r['peak_rss'])}, median of {r['runs']}"
                for r in rows
            ),
            f"DeepSpeed's own converter peaks at {fmt_size(ds['peak_rss'])}: it holds whole tensors, "
            "and a 5 GB shard's worth of them before writing it.",
        ],
    )
    return out, section
