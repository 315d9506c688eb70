"""The environment phase's view of a repository: a repo map (tree, README, dependency files,
test layout, entry points), the import graph between its modules, and the impact of a change
(which modules import the changed ones, which functions call the changed functions)."""

from __future__ import annotations

import ast
import configparser
import re
from pathlib import Path

from openglm.retrieval.spans import FunctionIndex, is_test_path

DEPENDENCY_FILES = ("pyproject.toml", "setup.cfg", "setup.py", "requirements.txt", "requirements-dev.txt",
                    "Pipfile", "environment.yml", "tox.ini")


def module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    if parts[0] == "src" and len(parts) > 1:
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph(index: FunctionIndex) -> dict[str, set[str]]:
    """{module: internal modules it imports}; relative imports resolved, externals dropped."""
    modules = {module_name(rel): rel for rel in index.sources}
    graph: dict[str, set[str]] = {}
    for rel, source in index.sources.items():
        me = module_name(rel)
        is_pkg = rel.endswith("__init__.py")
        deps: set[str] = set()
        try:
            tree = ast.parse(source)
        except SyntaxError:
            graph[me] = deps
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = me.split(".") if is_pkg else me.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                    base = ".".join(pkg + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]  # `a.b.c` -> the deepest internal module
                if name and name != me:
                    deps.add(name)
        graph[me] = deps
    return graph


def dependants(graph: dict[str, set[str]], changed: set[str]) -> set[str]:
    """Modules that import any changed module, directly or transitively."""
    reverse: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        for d in deps:
            reverse.setdefault(d, set()).add(mod)
    seen, todo = set(), list(changed)
    while todo:
        for user in reverse.get(todo.pop(), ()):
            if user not in seen and user not in changed:
                seen.add(user)
                todo.append(user)
    return seen


def callers(index: FunctionIndex, names: set[str]) -> list[str]:
    """Functions whose body calls one of `names` (by bare name or attribute: a name-based call graph)."""
    out = []
    for rel, fns in index.functions.items():
        lines = index.sources[rel].splitlines()
        for f in fns:
            body = "\n".join(lines[f.start_line:f.end_line])
            if any(re.search(rf"\b{re.escape(n)}\s*\(", body) for n in names):
                out.append(f.key)
    return out


def entry_points(repo: Path) -> list[str]:
    found = []
    pyproject = repo / "pyproject.toml"
    if pyproject.exists():
        import tomllib  # stdlib from Python 3.11 on; the project supports 3.10

        try:
            data = tomllib.loads(pyproject.read_text())
            found += [f"{k} = {v}" for k, v in data.get("project", {}).get("scripts", {}).items()]
        except tomllib.TOMLDecodeError:
            pass
    setup_cfg = repo / "setup.cfg"
    if setup_cfg.exists():
        cfg = configparser.ConfigParser()
        try:
            cfg.read(setup_cfg)
            found += [ln.strip() for ln in cfg.get("options.entry_points", "console_scripts",
                                                     fallback="").splitlines() if ln.strip()]
        except configparser.Error:
            pass
    found += [str(p.relative_to(repo)) for p in repo.rglob("__main__.py") if ".git" not in p.parts]
    return found


def repo_map(repo: str | Path, max_files: int = 300) -> dict:
    repo = Path(repo).resolve()
    index = FunctionIndex(repo)
    files = sorted(index.sources)
    readme = next((p for p in sorted(repo.glob("README*")) if p.is_file()), None)
    graph = import_graph(index)
    tests = [f for f in files if is_test_path(f)]
    return {
        "root": str(repo),
        "files": files[:max_files],
        "n_python_files": len(files),
        "readme": readme.read_text(errors="replace")[:3000] if readme else "",
        "dependency_files": {name: (repo / name).read_text(errors="replace")[:2000]
                             for name in DEPENDENCY_FILES if (repo / name).is_file()},
        "tests": {"files": tests[:max_files], "count": len(tests),
                  "dirs": sorted({t.rsplit("/", 1)[0] if "/" in t else "." for t in tests})},
        "entry_points": entry_points(repo),
        "import_graph": {m: sorted(d) for m, d in sorted(graph.items()) if d},
    }


def impact(repo: str | Path, changed: dict[str, list[str]]) -> dict:
    """changed = {file: [function qualnames]}; returns what else the change can affect."""
    index = FunctionIndex(Path(repo).resolve())
    graph = import_graph(index)
    mods = {module_name(f) for f in changed}
    users = dependants(graph, mods)
    names = {q.rsplit(".", 1)[-1] for qs in changed.values() for q in qs}
    call_sites = [c for c in callers(index, names) if c.split("::")[1].rsplit(".", 1)[-1] not in names]
    n_funcs = sum(len(q) for q in changed.values())
    return {"changed_files": sorted(changed), "changed_functions": n_funcs,
            "dependant_modules": sorted(users), "callers": call_sites,
            # the smaller, the less destructive: touched functions weigh most, then their reach
            "score": n_funcs + 0.2 * len(call_sites) + 0.1 * len(users) + 0.5 * (len(changed) - 1)}


def render(m: dict, max_lines: int = 80) -> str:
    """A compact text form for a prompt."""
    lines = [f"repository {m['root']} ({m['n_python_files']} Python files)", "files:"]
    lines += [f"  {f}" for f in m["files"][:max_lines]]
    if m["entry_points"]:
        lines.append("entry points: " + ", ".join(m["entry_points"]))
    lines.append(f"tests: {m['tests']['count']} files in {', '.join(m['tests']['dirs']) or '-'}")
    lines.append("dependency files: " + (", ".join(m["dependency_files"]) or "-"))
    if m["readme"]:
        lines += ["README (start):", m["readme"][:800]]
    return "\n".join(lines)
