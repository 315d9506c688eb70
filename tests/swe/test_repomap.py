"""repo map, import graph, dependants and the impact score used to rank candidate patches."""

from __future__ import annotations

from openglm.retrieval.spans import FunctionIndex
from openglm.swe.repomap import impact, import_graph, module_name, repo_map

FILES = {
    "pyproject.toml": '[project]\nname = "pkg"\n[project.scripts]\npkg = "pkg.cli:main"\n',
    "README.md": "# pkg\nA tiny package.\n",
    "src/pkg/__init__.py": "from .core import add\n",
    "src/pkg/core.py": "def add(a, b):\n    return a + b\n\ndef twice(a):\n    return add(a, a)\n",
    "src/pkg/cli.py": "from pkg import core\n\ndef main():\n    print(core.twice(2))\n",
    "src/pkg/util.py": "def lonely():\n    return 0\n",
    "tests/test_core.py": "from pkg.core import add\n\ndef test_add():\n    assert add(1, 2) == 3\n",
}


def test_map_and_graph(make_repo):
    repo, _ = make_repo("pkg", FILES)
    m = repo_map(repo)
    assert m["entry_points"] == ["pkg = pkg.cli:main"]
    assert "pyproject.toml" in m["dependency_files"] and m["readme"].startswith("# pkg")
    assert m["tests"]["files"] == ["tests/test_core.py"]
    assert module_name("src/pkg/__init__.py") == "pkg"
    graph = import_graph(FunctionIndex(repo))
    assert graph["pkg"] == {"pkg.core"} and graph["pkg.cli"] == {"pkg", "pkg.core"}
    assert graph["tests.test_core"] == {"pkg.core"}


def test_impact_grows_with_reach(make_repo):
    repo, _ = make_repo("pkg", FILES)
    core = impact(repo, {"src/pkg/core.py": ["add"]})
    lonely = impact(repo, {"src/pkg/util.py": ["lonely"]})
    assert "src/pkg/core.py::twice" in core["callers"] and "pkg.cli" in core["dependant_modules"]
    assert lonely["callers"] == [] and lonely["dependant_modules"] == []
    assert lonely["score"] < core["score"]
