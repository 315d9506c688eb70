"""The agent's diagnosis phase reaches the code knowledge base through the `search_code` tool."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from openglm.retrieval.code_index import CodeIndex, search_repository
from openglm.swe.policy.tools import CHECKS, PHASE_TOOLS, parse_check

ROOT = Path(__file__).resolve().parents[2]

PAYMENTS = '''
def apply_discount(total, rate):
    """Reduce the total by a fractional rate."""
    return total * (1 - rate)


class Ledger:
    def settle_invoice(self, invoice):
        return invoice.amount - invoice.paid
'''


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "shop").mkdir()
    (tmp_path / "shop" / "payments.py").write_text(PAYMENTS)
    (tmp_path / "shop" / "util.py").write_text("def slugify(name):\n    return name.lower().replace(' ', '-')\n")
    return tmp_path


def test_diagnosis_phase_offers_search_code():
    names = [t["function"]["name"] for t in PHASE_TOOLS["diagnosis"]]
    assert "search_code" in names and CHECKS["search_code"] == "search"
    assert "search_code" not in [t["function"]["name"] for t in PHASE_TOOLS["design"]]


def test_search_without_index_is_live_bm25(repo):
    hits, how = search_repository(repo, "settle_invoice fails", k=3)
    assert how == "bm25-live"
    assert hits[0].name == "Ledger.settle_invoice" and hits[0].location.startswith("shop/payments.py:")
    assert not (repo / ".openglm-index").exists()  # nothing was built or embedded


def test_search_uses_the_built_index(repo, embedder):
    CodeIndex.build(repo, embedder=embedder)
    hits, how = search_repository(repo, "apply_discount", k=3, mode="bm25")
    assert how == "bm25" and hits[0].name == "apply_discount"


def test_search_bad_input(repo, tmp_path):
    with pytest.raises(FileNotFoundError):
        search_repository(tmp_path / "missing", "x")
    with pytest.raises(ValueError, match="empty query"):
        search_repository(repo, "   ")


def test_checks_command_emits_hits(repo):
    out = subprocess.run([sys.executable, "-m", "openglm.swe.policy.checks", "search"], cwd=repo,
                         input=json.dumps({"query": "slugify a name", "k": 2}), capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    check = parse_check(out.stdout)
    assert check["how"] == "bm25-live" and check["hits"][0]["name"] == "slugify"
    assert "shop/util.py:1-2" in out.stdout
