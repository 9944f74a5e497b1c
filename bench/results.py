"""The recorded results (bench/results.json) and BENCHMARKS.md, rendered from them and nothing else.

Each benchmark's section is recorded with the run that measured it (date, command, tree, machine,
the machine's load while it ran), so `python -m bench --only NAME` replaces one section and the
report stays whole: a section from another run says so. The report holds the latest figures and
no history: what changed between runs is in the commits that changed results.json.
"""

from __future__ import annotations

import json
import re
import statistics
import threading
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.report import Row, Section, markdown_table

FORMAT = 1  # of results.json: bump when a key changes meaning
SIZE_NAMES = {"L": "~500k files, `--large`", "XL": "~1M files, `--only watchscale --sizes XL`"}


class LoadSampler:
    """The 1-minute load average every `every` seconds, on a thread: the machine is shared, and a
    figure means little without the load it was measured under."""

    def __init__(self, every: float = 5.0) -> None:
        self.every = every
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-load", daemon=True)

    def start(self) -> LoadSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every + 1)

    def _run(self) -> None:
        while True:
            self.samples.append(loadavg())
            if self._stop.wait(self.every):
                return

    def mark(self) -> int:
        """Where a section begins, for `since`."""
        self.samples.append(loadavg())
        return len(self.samples) - 1

    def since(self, mark: int) -> dict[str, float]:
        xs = [*self.samples[mark:], loadavg()]
        return {"min": min(xs), "median": round(statistics.median(xs), 2), "max": max(xs)}


def loadavg() -> float:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return -1.0


def record(name: str, rows: list[Row], section: Section, run: dict[str, Any], took_s: float,
           load: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    """One section as results.json keeps it."""
    return {
        "name": name,
        "title": section.title,
        "run": run,
        "took_s": round(took_s, 1),
        "load": load,
        "method": section.method,
        "details": section.details,
        "rows": [asdict(r) for r in rows],
    }


def load(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"format": FORMAT, "sections": {}}
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT:
        raise SystemExit(f"python -m bench: {path} is of format {doc.get('format')!r}, not {FORMAT}")
    return doc


def merge(doc: dict[str, Any], sections: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """`doc` with these sections in place of the ones of the same name."""
    out = {"format": FORMAT, "sections": dict(doc.get("sections", {}))}
    for s in sections:
        out["sections"][s["name"]] = s
    out["sections"] = dict(sorted(out["sections"].items(), key=lambda kv: _number(kv[1]["title"])))
    return out


def dump(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def _number(title: str) -> tuple[int, str]:
    m = re.match(r"(\d+)\.", title)
    return (int(m.group(1)) if m else 1000, title)


# --- BENCHMARKS.md ---------------------------------------------------------------------------


def _run_key(run: dict[str, Any]) -> str:
    return f"{run['date']}|{run['command']}|{run['tree']}"


def _load_text(load: dict[str, float]) -> str:
    return f"{load['min']:g}–{load['max']:g} (median {load['median']:g})"


def _run_lines(run: dict[str, Any], sections: list[dict[str, Any]]) -> list[str]:
    loads = [s["load"] for s in sections]
    low, high = min(x["min"] for x in loads), max(x["max"] for x in loads)
    m = run["machine"]
    took = run["took_s"]
    took_text = f"{took / 60:.0f} min" if took >= 120 else f"{took:.0f} s"
    lines = [
        f"- **date**: {run['date']}",
        f"- **command**: `{run['command']}` ({took_text} in all, volumes built included)",
        f"- **tree**: {run['tree']}",
        f"- **machine**: {m.get('CPU', '?')}, {m.get('memory', '?')}; kernel {m.get('kernel', '?')}",
        f"- **load average** (1 min, sampled every 5 s): {low:g}–{high:g} on {m.get('cores', '?')} cores",
        f"- **bench directory**: {m.get('bench directory', '?')}",
        f"- **software**: python {m.get('python', '?')}, watchdog {m.get('watchdog', '?')}, "
        f"torch {m.get('torch', '?')}; ckptd byte-compiled first, as pip does",
    ]
    left = [f"{n} ({SIZE_NAMES[n]})" for n in SIZE_NAMES if n not in run.get("sizes", [])]
    if left and "T" not in run.get("sizes", []):
        lines.append(f"- **not measured in this run**: the {' and '.join(left)} volumes")
    reached = {s["name"] for s in sections}
    missing = [n for n in run.get("asked", []) if n not in reached]
    if missing:
        lines.append(f"- **asked for, not finished in this run**: {', '.join(missing)}")
    if run.get("volumes"):
        lines.append(
            "- **volumes** (`bench/volume.py`: Trainer + DeepSpeed ZeRO-2 checkpoints, all complete):"
        )
        lines += [f"  {v}" for v in run["volumes"]]
    return lines


def render(doc: dict[str, Any]) -> str:
    """BENCHMARKS.md from results.json: the runs, one table, a short note per missed target."""
    sections = list(doc["sections"].values())
    runs: dict[str, list[dict[str, Any]]] = {}
    for s in sections:
        runs.setdefault(_run_key(s["run"]), []).append(s)
    # The run with the most sections is the main one; the others' rows say which run they are from.
    order = sorted(runs, key=lambda k: -len(runs[k]))
    label = {k: "" if i == 0 else f" ({chr(ord('A') + i)})" for i, k in enumerate(order)}
    out = [
        "# ckptd benchmarks",
        "",
        "Generated by `python -m bench` from `bench/results.json` (do not edit: rerun it; `--only NAME`",
        "refreshes one section). Every figure is a median of repetitions, measured beside its baseline in",
        "the same run on a shared machine: read the ratios, not single times, and mind the load. Earlier",
        "runs are in the git history of `bench/results.json`.",
        "",
    ]
    for i, key in enumerate(order):
        if i:
            names = ", ".join(s["title"] for s in runs[key])
            out += ["", f"### Run {chr(ord('A') + i)}: {names}", ""]
        out += _run_lines(runs[key][0]["run"], runs[key])
    rows = [(Row(**r), s) for s in sections for r in s["rows"]]
    shown = [Row(**{**asdict(r), "benchmark": r.benchmark + label[_run_key(s["run"])]}) for r, s in rows]
    out += ["", "## Results", "", markdown_table(shown), ""]
    out += _notes([r for r, _ in rows])
    out += ["## Sections", "",
            "How each measures is its module's docstring (`bench/NAME.py`); the breakdowns behind each row "
            "are the section's `details` in `bench/results.json`.", ""]  # fmt: skip
    for s in sections:
        out.append(
            f"- **{s['title']}** (`{s['name']}`): took {s['took_s']:.0f} s, load {_load_text(s['load'])}."
        )
    return "\n".join(out).rstrip() + "\n"


def _notes(rows: list[Row]) -> list[str]:
    """One line per missed target's reason; rows that share a reason share the line."""
    missed: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if r.met is False:
            missed.setdefault((r.benchmark, r.note or "no reason recorded."), []).append(r.case)
    if not missed:
        return []
    out = ["## Why a target is missed", ""]
    out += [f"- **{b}** ({'; '.join(cases)}): {note}" for (b, note), cases in missed.items()]
    return [*out, ""]
