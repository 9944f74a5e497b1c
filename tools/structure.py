"""The package's structure, measured from its imports and one real `ckptd prune`.

    python -m tools.structure [PACKAGE_DIR]     # default: the ckptd package this checkout imports

Prints:
- the modules at the package's top (its public faces should be all that sits there);
- the import circles: strongly connected sets of modules, counting every import (a module's own
  and those inside functions, which is how a circle is usually held open), and each edge's kind;
- the floors: a module's floor is one more than the highest floor it imports (a module importing
  nothing of ckptd is on floor 0), computed on the circles collapsed;
- the walk from `ckptd prune` to the first rename into the trash: a real prune of `ckptd demo`'s
  volume, traced with `sys.setprofile`; the ckptd files it passes through, and the calls that
  climb back up, from a module on a lower floor into one on a higher floor (a callback, an
  in-function import, or an object handed down);
- the daemon's parts (`--parts`, or by default): for each class or function of `daemon/` outside
  `core.py` that is handed the `Daemon` or the parts' shared state (`DaemonState`), by a parameter
  so annotated, which of that object's attributes it reaches (read or written), and how many of
  them are private (a leading underscore).

Reads the source and runs one prune in a temporary directory; changes nothing else.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path


def module_name(pkg_dir: Path, path: Path) -> str:
    rel = path.relative_to(pkg_dir.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(pkg_dir: Path) -> dict[str, dict[str, str]]:
    """module -> {imported module: 'top' | 'function'} (only modules of the package)."""
    files = {module_name(pkg_dir, p): p for p in pkg_dir.rglob("*.py") if "__pycache__" not in p.parts}
    graph: dict[str, dict[str, str]] = {m: {} for m in files}
    root = pkg_dir.name
    for mod, path in files.items():
        tree = ast.parse(path.read_text())
        is_pkg = path.name == "__init__.py"
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]

        def visit(node, kind):
            for child in ast.iter_child_nodes(node):
                k = kind
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    k = "function"
                elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    k = "typing"
                if isinstance(child, ast.ImportFrom):
                    target = child.module or ""
                    if child.level:
                        up = base[: len(base) - (child.level - 1)]
                        target = ".".join(up + ([child.module] if child.module else []))
                    names = [f"{target}.{a.name}" for a in child.names]
                    for t in [n for n in names if n in files] or [target]:
                        if t in files and t != mod:
                            graph[mod].setdefault(t, k)
                elif isinstance(child, ast.Import):
                    for a in child.names:
                        if a.name.split(".")[0] == root:
                            t = a.name
                            while t not in files and "." in t:
                                t = t.rsplit(".", 1)[0]
                            if t in files and t != mod:
                                graph[mod].setdefault(t, k)
                visit(child, k)

        visit(tree, "top")
    # importing a.b.c runs a/__init__ and a/b/__init__ too; those are not edges of interest
    return graph


def circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1 (typing-only edges left out)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, kind in graph[v].items():
            if kind == "typing" or _is_parent_package(w, v):
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _is_parent_package(target: str, mod: str) -> bool:
    # a package's __init__ re-exporting its own modules, and a module importing its package's
    # __init__, are one unit: not a circle between stages
    return mod.startswith(target + ".") or target.startswith(mod + ".")


def _stage(mod: str, root: str) -> str:
    parts = mod.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else root


def _stage_graph(graph, root):
    out: dict[str, dict[str, str]] = {}
    for m, deps in graph.items():
        out.setdefault(_stage(m, root), {})
        for d, kind in deps.items():
            a, b = _stage(m, root), _stage(d, root)
            if a != b and kind != "typing" and b != root:
                out[a].setdefault(b, kind)
                out.setdefault(b, {})
    return out


def floors(graph, comps) -> dict[str, int]:
    member = {m: i for i, c in enumerate(comps) for m in c}
    node = lambda m: member.get(m, m)  # noqa: E731
    dag: dict[object, set] = {}
    for m, deps in graph.items():
        for d, kind in deps.items():
            if kind != "typing" and not _is_parent_package(d, m) and node(d) != node(m):
                dag.setdefault(node(m), set()).add(node(d))
    memo: dict[object, int] = {}

    def floor(n):
        if n not in memo:
            memo[n] = 0
            memo[n] = 1 + max((floor(d) for d in dag.get(n, ())), default=-1)
        return memo[n]

    return {m: floor(node(m)) for m in graph}


SHARED = ("Daemon", "DaemonState")  # what the daemon's parts may be handed whole


def _annotation(arg: ast.arg) -> str:
    return ast.unparse(arg.annotation).strip("'\"") if arg.annotation is not None else ""


def _reached(body: list[ast.stmt], names: set[str], selves: set[str]) -> dict[str, set[str]]:
    """{shared attribute reached: {'read', 'write'}} in `body`, where `names` are locals bound to a
    shared object and `selves` the attributes of `self` holding one (`self.d = daemon`)."""
    out: dict[str, set[str]] = {}
    names = set(names)
    nodes = [n for stmt in body for n in ast.walk(stmt)]
    # aliases: `d = self.d`, `daemon = self.d`, `d, tr = self.d, rt.tracker`
    for n in nodes:
        if isinstance(n, ast.Assign):
            pairs = [(n.targets[0], n.value)]
            if isinstance(n.targets[0], ast.Tuple) and isinstance(n.value, ast.Tuple):
                pairs = list(zip(n.targets[0].elts, n.value.elts, strict=False))
            for t, v in pairs:
                if isinstance(t, ast.Name) and _is_shared(v, names, selves):
                    names.add(t.id)
    for n in nodes:
        if isinstance(n, ast.Attribute) and _is_shared(n.value, names, selves):
            out.setdefault(n.attr, set()).add("write" if isinstance(n.ctx, ast.Store) else "read")
    return out


def _is_shared(node: ast.AST, names: set[str], selves: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    return (isinstance(node, ast.Attribute) and node.attr in selves
            and isinstance(node.value, ast.Name) and node.value.id == "self")


def parts(pkg_dir: Path) -> list[tuple[str, str, dict[str, set[str]]]]:
    """(part, shared type, {attribute: {'read', 'write'}}) for each class or module-level function
    of `daemon/` but `core.py` that is handed a `Daemon` or `DaemonState`."""
    out = []
    for path in sorted((pkg_dir / "daemon").glob("*.py")):
        if path.name == "core.py":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                methods = [f for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
                init = next((f for f in methods if f.name == "__init__"), None)
                if init is None:
                    continue
                typed = {a.arg: _annotation(a) for a in init.args.args + init.args.kwonlyargs}
                for kind in SHARED:
                    params = {a for a, t in typed.items() if t == kind}
                    selves = {t.attr for st in ast.walk(init) if isinstance(st, ast.Assign)
                              and isinstance(st.value, ast.Name) and st.value.id in params
                              for t in st.targets if isinstance(t, ast.Attribute)}
                    if params:
                        reached: dict[str, set[str]] = {}
                        for f in methods:
                            for k, v in _reached(f.body, params if f is init else set(), selves).items():
                                reached.setdefault(k, set()).update(v)
                        out.append((f"{node.name} ({path.name})", kind, reached))
            elif isinstance(node, ast.FunctionDef):
                for kind in SHARED:
                    params = {a.arg for a in node.args.args + node.args.kwonlyargs if _annotation(a) == kind}
                    if params:
                        out.append((f"{node.name} ({path.name})", kind, _reached(node.body, params, set())))
    return out


def walk(pkg_dir: Path) -> list[str]:
    """Each call (caller's module, callee's module) a real `ckptd prune` of the demo volume makes
    between ckptd's own functions, up to its first rename into the trash."""
    sys.path.insert(0, str(pkg_dir.parent))
    from ckptd.cli import main  # noqa: PLC0415 (the package measured, imported from its own tree)

    tmp = Path(tempfile.mkdtemp(prefix="ckptd-structure-"))
    with contextlib.redirect_stdout(io.StringIO()):
        main(["demo", str(tmp / "demo")])
    config = next((tmp / "demo").glob("*.toml"))
    os.environ.setdefault("CKPTD_TRASH_GRACE", "0")
    os.environ["CKPTD_STATE_DIR"] = str(tmp / "state")
    calls: list[tuple[str, str]] = []
    prefix = str(pkg_dir) + os.sep
    done = []

    def ckptd_module(frame):
        while frame is not None and not frame.f_code.co_filename.startswith(prefix):
            frame = frame.f_back
        return None if frame is None else module_name(pkg_dir, Path(frame.f_code.co_filename))

    def profile(frame, event, arg):
        if done:
            return
        if event == "call" and frame.f_code.co_filename.startswith(prefix):
            callee, caller = ckptd_module(frame), ckptd_module(frame.f_back)
            if caller is not None:
                calls.append((caller, callee))
        elif event == "c_call" and getattr(arg, "__name__", "") in ("rename", "renameat2") and calls:
            done.append(True)

    sys.setprofile(profile)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main(["prune", "-q", "-c", str(config)])
    finally:
        sys.setprofile(None)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("package", nargs="?", type=Path, default=Path(__file__).resolve().parents[1] / "ckptd")
    ap.add_argument("--no-walk", action="store_true", help="skip the traced prune")
    ap.add_argument("--parts", action="store_true", help="only the daemon's parts and what they reach")
    args = ap.parse_args()
    pkg = args.package.resolve()
    print_parts(pkg)
    if args.parts:
        return
    graph = imports(pkg)
    top = sorted(p.name for p in pkg.glob("*.py"))
    print(f"modules at the top of {pkg.name}/: {len(top)}: {', '.join(top)}")
    comps = circles(graph)
    print(f"import circles: {len(comps)}")
    for c in comps:
        inner = sorted(f"{a} -> {b} ({k})" for a in c for b, k in graph[a].items() if b in c and not _is_parent_package(b, a))
        print(f"  {len(c)} modules: {', '.join(c)}")
        for e in inner:
            print(f"    {e}")
    stages = _stage_graph(graph, pkg.name)
    stage_comps = circles(stages)
    print(f"circles between stages (sub-packages and top modules): {len(stage_comps)}")
    for c in stage_comps:
        print(f"  {', '.join(c)}")
        for a in c:
            for b in sorted(b for b in stages[a] if b in c):
                print(f"    {a} -> {b}: " + ", ".join(sorted(f"{x}->{y}" for x in graph for y in graph[x]
                                                        if _stage(x, pkg.name) == a and _stage(y, pkg.name) == b
                                                        and graph[x][y] != "typing"))[:300])
    fl = floors(graph, comps)
    print(f"floors: {max(fl.values()) + 1}")
    if args.no_walk:
        return
    calls = walk(pkg)
    steps = [(a, b) for a, b in calls if a != b]
    up = [(a, b) for a, b in steps if fl.get(b, 0) > fl.get(a, 0)]
    files = sorted({m for pair in calls for m in pair})
    print(f"prune -> first rename: {len(files)} files; {len(set(steps))} distinct calls between files "
          f"({len(steps)} made), {len(set(up))} of them up a floor ({len(up)} made)")
    for a, b in sorted(set(up)):
        print(f"  up: {a} (floor {fl[a]}) -> {b} (floor {fl[b]})")


def print_parts(pkg: Path) -> None:
    found = parts(pkg)
    every = {a for _, _, r in found for a in r}
    private = sorted(a for a in every if a.startswith("_"))
    print(f"daemon parts handed the Daemon or DaemonState whole: {len(found)}; attributes reached: "
          f"{len(every)}, {len(private)} private{': ' + ', '.join(private) if private else ''}")
    for name, kind, reached in found:
        priv = [a for a in sorted(reached) if a.startswith("_")]
        written = [a for a in sorted(reached) if "write" in reached[a]]
        print(f"  {name} <- {kind}: {len(reached)} attributes ({len(priv)} private, {len(written)} written): "
              + ", ".join(a + ("=" if a in written else "") for a in sorted(reached)))


if __name__ == "__main__":
    main()
