"""The package graph: every import between openglm's packages points the allowed way.

The allowed graph is written here, once (docs/contracts.md draws it). The test parses every module
with `ast` (module-level and function-level imports alike, so a cycle cannot hide in a function)
and fails on an import the graph does not allow, on a cycle, and on a function-level import without
a comment saying why it is deferred (an optional or heavy dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "openglm"

# package -> the packages it may import. `util` is the leaf every package may use; `cli` (the
# top-level entry point, openglm/cli.py) may import anything.
ALLOWED: dict[str, set[str]] = {
    "util": set(),
    "kernels": set(),  # the Triton GPU kernels: tensors in, tensors out (the model imports them only for CUDA)
    "model": {"kernels", "util"},
    "tokenizer": {"util"},
    "client": {"util"},
    "retrieval": {"tokenizer", "util"},
    "train": {"model", "tokenizer", "util"},
    "engine": {"model", "tokenizer", "util"},
    "server": {"engine", "tokenizer", "util"},  # the HTTP app around a built engine
    "deploy": {"server", "engine", "model", "tokenizer", "util"},  # builds the engine, starts the server
    "agent": {"retrieval", "client", "util"},
    "swe": {"agent", "retrieval", "client", "model", "tokenizer", "util"},
    "doctor": {"agent", "train", "model", "tokenizer", "util"},  # reads what the others write: checks, never changes
    "__init__": {"util"},  # openglm/__init__.py: lazy exports name their modules as strings
    "__main__": {"cli"},
}
ANYTHING = {"cli"}

# Inside `model`: the shared modules (openglm/model/*.py: the decoder, config, MoE, norms, RoPE, cache, checkpoint IO,
# native kernels, fast paths) and one folder per model family. A family imports shared modules and the families
# listed for it here; a shared module imports no family, except the registry that lists them all.
MODEL_FAMILIES: dict[str, set[str]] = {
    "glm5": set(),  # GLM-5: MLA + DSA
    "glm4": set(),  # GLM-4.x: GQA
    "glm4_lite": {"glm5"},  # GLM-4.7-Flash: GLM-5's MLA without the indexer
    "glm5_next": {"glm5"},  # GLM-5.3-Flash: GLM-5's MLA (NoPE) and DSA code with a pooled indexer, KDA layers
}
FAMILY_REGISTRY = "openglm.model.families"
# Shared modules that may still reach into a family: the CUDA dispatch hands DSA cases its kernels do not take back
# to GLM-5's PyTorch gather (a deferred import).
FAMILY_USERS = {FAMILY_REGISTRY, "openglm.model.gpu"}


def package_of(module: str) -> str | None:
    """'openglm.agent.loop' -> 'agent'; 'openglm.tokenizer' -> 'tokenizer'; 'openglm' -> '__init__'."""
    parts = module.split(".")
    if parts[0] != "openglm":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def module_of(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target == "openglm":  # `from openglm import retrieval` imports a package; `import __version__` the root
        return [f"openglm.{a.name}" if (PACKAGE / a.name).is_dir() or (PACKAGE / f"{a.name}.py").is_file()
                else target for a in node.names]
    return [target]


def function_level(tree: ast.Module) -> dict[int, tuple[int, int]]:
    """id of each import node inside a function -> (first, last line) of its run of consecutive
    imports: one comment above or in a run explains the whole run."""
    inner = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            for body in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
                run: list[ast.stmt] = []
                for stmt in [*body, None] if isinstance(body, list) else []:
                    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                        run.append(stmt)
                        continue
                    for imp in run:
                        inner[id(imp)] = (run[0].lineno, run[-1].end_lineno)
                    run = []
    return inner


def scan():
    """(source package, target package, 'path:line', function-level?, has a comment?) for every import
    of another openglm package, plus every function-level import (any module) for the comment rule."""
    arrows, deferred = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        module, is_package = module_of(path)
        src = package_of(module)
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        inner = function_level(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if id(node) in inner:
                first, last = inner[id(node)]
                span = lines[first - 2:last]  # the line above the run, and the run
                deferred.append((where, any("#" in line for line in span)))
            for target in imported_modules(node, module, is_package):
                dst = package_of(target)
                if dst is not None and dst != src:
                    arrows.append((src, dst, where))
    return arrows, deferred


def test_the_allowed_graph_has_no_cycle():
    state: dict[str, int] = {}

    def visit(p, trail):
        assert state.get(p) != 1, f"cycle in ALLOWED: {' -> '.join(trail + [p])}"
        if state.get(p) == 2:
            return
        state[p] = 1
        for q in ALLOWED.get(p, ()):
            visit(q, trail + [p])
        state[p] = 2

    for p in ALLOWED:
        visit(p, [])


def test_deployment_sits_on_top():
    """How a server is started (checkpoint loading, sharding, torchrun, the vLLM/SGLang hand-off) is deploy's:
    the packages it starts import none of it; only the entry point (cli.py) does."""
    assert not [p for p, deps in ALLOWED.items() if "deploy" in deps]
    assert {"server", "engine"} <= ALLOWED["deploy"]


def test_every_package_import_points_the_allowed_way():
    arrows, _ = scan()
    assert arrows, "the scan found no imports between packages: it is broken"
    known = set(ALLOWED) | ANYTHING
    wrong = [f"{where}: {src} imports {dst}" for src, dst, where in arrows
             if src not in ANYTHING and (src not in known or dst not in ALLOWED[src])]
    assert not wrong, "imports against the package graph (tests/test_architecture.py ALLOWED):\n" + "\n".join(wrong)


def test_function_level_imports_say_why():
    _, deferred = scan()
    silent = [where for where, commented in deferred if not commented]
    assert not silent, ("function-level imports without a comment (import at module level, or say why it is "
                        "deferred: an optional or heavy dependency):\n" + "\n".join(silent))


def family_of(module: str) -> str | None:
    """'openglm.model.glm5.mla' -> 'glm5'; a shared module ('openglm.model.fast') or another package -> None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "model" and parts[2] in model_folders() else None


def model_folders() -> set[str]:
    return {p.name for p in (PACKAGE / "model").iterdir() if (p / "__init__.py").is_file()}


def test_every_model_family_folder_is_listed():
    assert model_folders() == set(MODEL_FAMILIES), (
        "openglm/model's family folders and MODEL_FAMILIES (tests/test_architecture.py) differ: list a new family "
        f"with the families it may import: folders {sorted(model_folders())}, listed {sorted(MODEL_FAMILIES)}")


def test_model_families_import_shared_modules_and_their_listed_families_only():
    wrong, seen = [], 0
    for path in sorted((PACKAGE / "model").rglob("*.py")):
        module, is_package = module_of(path)
        src = family_of(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in imported_modules(node, module, is_package):
                names = [target] + ([] if isinstance(node, ast.Import) else [f"{target}.{a.name}" for a in node.names])
                dst = next((f for f in map(family_of, names) if f is not None), None)
                if dst is None or dst == src:
                    continue
                seen += 1
                allowed = module in FAMILY_USERS if src is None else dst in MODEL_FAMILIES.get(src, set())
                if not allowed:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {src or 'shared ' + module} imports {dst}")
    assert seen, "the scan found no imports of a model family: it is broken"
    assert not wrong, "imports against the model's family graph (MODEL_FAMILIES):\n" + "\n".join(wrong)


def test_the_scan_sees_function_level_and_relative_imports(tmp_path):
    tree = ast.parse("from .guard import Guard\n\ndef f():\n    from openglm.model import sampling  # heavy\n")
    inner = function_level(tree)
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert [id(n) in inner for n in nodes] == [False, True]
    assert imported_modules(nodes[0], "openglm.agent.resilience.hooks", False) == ["openglm.agent.resilience.guard"]
    assert package_of(imported_modules(nodes[1], "openglm.agent.x", False)[0]) == "model"
    root = ast.parse("from openglm import retrieval").body[0]
    assert imported_modules(root, "openglm.swe.localize", True) == ["openglm.retrieval"]


# ---- plumbing written once: commands, kills and git go through openglm.util ----------------------------

# Where a process may be started or a process group killed: util/proc.py, and the reaper launcher
# (unsandboxed commands), which runs as a bare script (`python -I -S`) and so cannot import openglm.
PROCESS_MODULES = {"openglm/util/proc.py", "openglm/util/reaper.py"}
COMPUTE_PACKAGES = {"model", "train"}  # build their kernels with a compiler; they run no user command
STARTS = {("subprocess", name) for name in ("run", "Popen", "call", "check_call", "check_output")} | \
    {("os", name) for name in ("system", "popen", "killpg", "posix_spawn", "posix_spawnp")}


def plumbing_calls():
    """('path:line', what) for each process start / group kill and each `["git", ...]` argv in openglm."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if package_of(module_of(path)[0]) in COMPUTE_PACKAGES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in STARTS:
                found.append((rel, node.lineno, f"{node.func.value.id}.{node.func.attr}"))
            elif isinstance(node, ast.List) and node.elts and isinstance(node.elts[0], ast.Constant) and \
                    node.elts[0].value == "git":
                found.append((rel, node.lineno, "git argv"))
    return found


def test_commands_kills_and_git_run_through_util():
    found = plumbing_calls()
    assert any(rel == "openglm/util/proc.py" for rel, _, _ in found), "the scan found no process start: it is broken"
    wrong = [f"{rel}:{line}: {what}" for rel, line, what in found
             if rel not in PROCESS_MODULES and not (what == "git argv" and rel == "openglm/util/git.py")]
    assert not wrong, ("start commands with openglm.util.proc (its timeout kills the whole group) and git with "
                       "openglm.util.git:\n" + "\n".join(wrong))


# The agent runtime (the step loop and what it reads) knows nothing of the layers built on it: the
# resilience layer plugs in through the hooks, the dashboard and the HTTP API sit on top.
AGENT_LAYERS = ("openglm.agent.resilience", "openglm.agent.dashboard", "openglm.agent.api", "openglm.agent.server",
                "openglm.agent.cli")
AGENT_RUNTIME = ["loop.py", "state.py", "hooks.py", "policy.py", "task.py", "worker.py", "process.py", "snapshot.py",
                 "watch.py", "faults.py", "config.py", "service.py", "trust.py", "store", "tools", "llm"]


def test_the_agent_runtime_does_not_import_the_layers_on_it():
    agent = PACKAGE / "agent"
    paths = [p for name in AGENT_RUNTIME for p in ([agent / name] if name.endswith(".py") else
                                                    sorted((agent / name).rglob("*.py")))]
    wrong = []
    for path in paths:
        module, is_package = module_of(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported_modules(node, module, is_package):
                    if target.startswith(AGENT_LAYERS):
                        wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {target}")
    assert len(paths) > 20 and not wrong, "\n".join(wrong)


def module_graph(prefix: str) -> dict[str, set[str]]:
    """Module-level imports between the modules under `prefix` (function-level imports are deferred on purpose)."""
    modules = {module_of(p)[0]: p for p in sorted(PACKAGE.rglob("*.py")) if module_of(p)[0].startswith(prefix)}
    graph = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text())
        inner = function_level(tree)
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in inner:
                for target in imported_modules(node, module, is_package):
                    names = [target] + ([f"{target}.{a.name}" for a in node.names]
                                        if isinstance(node, ast.ImportFrom) else [])
                    deps.update(n for n in names if n in modules and n != module)
        graph[module] = deps
    return graph


def test_no_import_cycle_between_the_models_modules():
    """model.py saves itself through save.py (`GlmMoeDsaForCausalLM.save_pretrained`), and checkpoint.py builds
    models: save.py must import neither, or the modules import each other."""
    graph = module_graph("openglm.model")
    assert "openglm.model.save" in graph["openglm.model.model"], "the scan lost model.py -> save.py"
    state: dict[str, int] = {}

    def visit(m, trail):
        assert state.get(m) != 1, f"import cycle: {' -> '.join(trail + [m])}"
        if state.get(m) == 2:
            return
        state[m] = 1
        for dep in sorted(graph[m]):
            visit(dep, trail + [m])
        state[m] = 2

    for m in graph:
        visit(m, [])
