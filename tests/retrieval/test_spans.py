"""The one code-span model of retrieval and swe: the definitions walker and the function index."""

import ast
import textwrap

from openglm.retrieval.chunking import chunk_python
from openglm.retrieval.spans import FunctionIndex, definitions, functions_with_qualnames

SOURCE = textwrap.dedent('''
    import sys

    if sys.version_info >= (3, 8):
        def compat():
            return 1

    class Shop:
        """A shop."""

        @property
        def total(self):
            def inner():
                return 2
            return inner()

    def outer():
        class Local:
            def method(self):
                pass
        return Local
''').lstrip()


def test_walker_names_kinds_and_blocks():
    tree = ast.parse(SOURCE)
    top = definitions(tree.body, blocks=False)  # what chunking cuts: no definitions inside if-blocks
    assert [(d.qualname, d.kind) for d in top] == [("Shop", "class"), ("outer", "function")]
    assert [(m.qualname, m.kind) for m in top[0].members] == [("Shop.total", "method")]
    assert [q for q, _ in functions_with_qualnames(tree)] == [  # what swe indexes: every function
        "compat", "Shop.total", "Shop.total.inner", "outer", "outer.Local.method"]


def test_function_index_and_chunks_share_the_span_model(tmp_path):
    (tmp_path / "shop.py").write_text(SOURCE)
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "skipped.py").write_text("def nope(): pass\n")
    index = FunctionIndex(tmp_path)
    assert list(index.functions) == ["shop.py"]
    inner = index.function_at("shop.py", SOURCE.splitlines().index("            return 2") + 1)
    assert (inner.name, inner.kind, inner.key) == ("Shop.total.inner", "function", "shop.py::Shop.total.inner")
    chunk = next(c for c in chunk_python("shop.py", SOURCE) if c.name == "Shop.total")
    assert chunk.kind == "method" and chunk.location == f"shop.py:{chunk.start_line}-{chunk.end_line}"
    assert chunk.start_line == index.function_at("shop.py", chunk.end_line).start_line - 1  # the decorator line
