"""Code-context labels: each category on a hand-written source, byte vs character columns, BPE tokens labelled by
their first visible character, document kinds, and unparsable sources refused."""

import pytest

from openglm.train.code_context import CONTEXT, LEXICAL, LabelError, char_labels, document_kind, token_labels

SOURCE = '''"""Module doc."""
import os
from a import (b,
    c)

@decorator(1)
def f(x: int = g(2), *, y="s") -> List[int]:
    """Doc é."""
    # note
    if x and h(y):
        return k(x, 'q')
    else:
        z = x + 1  # trailing
    s = "é" + m(z)
    v = f"{z}"
'''


def context_at(labels, needle: str, occurrence: int = 0) -> str:
    at = -1
    for _ in range(occurrence + 1):
        at = SOURCE.index(needle, at + 1)
    return CONTEXT[labels.context[at]]


def test_each_context_category():
    lab = char_labels(SOURCE)
    assert context_at(lab, '"""Module') == "docstring"
    assert context_at(lab, "import os") == "import" and context_at(lab, "c)") == "import"
    assert context_at(lab, "@decorator") == "decorator" and context_at(lab, "decorator(") == "decorator"
    assert context_at(lab, "(1)") == "call_args"  # the innermost construct wins
    assert context_at(lab, "def f") == "signature" and context_at(lab, "-> List") == "signature"
    assert context_at(lab, "(2)") == "call_args"  # a call in a default: the innermost construct wins
    assert context_at(lab, '"s"') == "string"
    assert context_at(lab, '"""Doc') == "docstring"
    assert context_at(lab, "# note") == "comment" and context_at(lab, "# trailing") == "comment"
    assert context_at(lab, "if x") == "control" and context_at(lab, "return") == "control"
    assert context_at(lab, "(y)") == "call_args" and context_at(lab, "(x, 'q')") == "call_args"
    assert context_at(lab, "'q'") == "string"
    else_at = SOURCE.index("else:")
    assert {CONTEXT[c] for c in lab.context[else_at:else_at + 5]} == {"control"}  # the keyword and its colon
    assert context_at(lab, "z = x") == "code" and context_at(lab, "+ 1") == "code"
    assert context_at(lab, 'f"{z}"') == "string"


def test_columns_after_non_ascii_text():
    """ast counts UTF-8 bytes, tokenize characters: after "é" (two bytes) both still land on the same character."""
    lab = char_labels(SOURCE)
    assert context_at(lab, "(z)") == "call_args" and context_at(lab, "m(z)") == "code"
    assert context_at(lab, '"é"') == "string"


def test_lexical_categories():
    lab = char_labels(SOURCE)
    needles = ("def", "f(x", "->", "1)", '"s"', "# note")
    kind = {needle: LEXICAL[lab.lexical[SOURCE.index(needle)]] for needle in needles}
    assert kind == {"def": "keyword", "f(x": "identifier", "->": "operator", "1)": "number", '"s"': "string",
                    "# note": "comment"}
    assert LEXICAL[lab.lexical[SOURCE.index("\n")]] == "layout"


def test_tokens_take_their_first_visible_character():
    source = "x = 1\n    # hi\n"
    offsets = [(0, 1), (1, 3), (3, 5), (5, 10), (10, 14), (14, 15)]  # "x", " =", " 1", "\n    ", "# hi", "\n"
    lab = token_labels(source, offsets)
    assert [CONTEXT[c] for c in lab.context] == ["code", "code", "code", "layout", "comment", "layout"]
    assert [LEXICAL[c] for c in lab.lexical] == ["identifier", "operator", "number", "layout", "comment", "layout"]


def test_document_kinds():
    assert document_kind("pkg/test_x.py", "") == "test" and document_kind("tests/helpers.py", "") == "test"
    assert document_kind("json/__init__.py", "") == "package_init"
    assert document_kind("tool.py", "if __name__ == '__main__':\n    main()\n") == "script"
    assert document_kind("os.py", "import sys\n") == "module"


@pytest.mark.parametrize("source", ["def f(:\n", "x = 'open\n", "a = 1\rb = 2\n"])
def test_unparsable_source_is_refused(source):
    with pytest.raises(LabelError):
        char_labels(source)
