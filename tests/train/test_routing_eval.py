"""Routing accuracy, NMI and balance on hand-made routes (routing that encodes the category scores 1, routing that
ignores it scores the majority rate), the captured routes of a model ordered by gate weight, and labelled windows
aligned with their tokens."""

import numpy as np
import pytest
import torch
from torch import nn

from openglm.model.router import Routing
from openglm.train.code_context import CONTEXT, LEXICAL
from openglm.train.routing_eval import (
    LabelledWindows,
    balance,
    capture_routing,
    category_load,
    context_decided,
    evaluate_routing,
    labelled_windows,
    lookup_accuracy,
    nmi,
    routing_features,
)


def test_lookup_accuracy_by_hand():
    # feature 0 -> mostly class 1, feature 1 -> class 0; feature 2 is unseen: the overall majority (class 0)
    f_fit, y_fit = np.array([0, 0, 0, 1, 1]), np.array([1, 1, 0, 0, 0])
    assert lookup_accuracy(f_fit, y_fit, np.array([0, 1, 2, 0]), np.array([1, 0, 0, 0])) == 0.75  # wrong: the last


def test_sets_are_unordered_and_unseen_sets_have_no_column():
    fit = np.array([[[1, 3]], [[3, 1]], [[0, 2]]])  # [n, layers=1, k=2]
    test = np.array([[[3, 1]], [[2, 5]]])
    x_fit, x_test = routing_features(fit, test, n_experts=6)
    assert x_fit.shape == (3, 2) and (x_fit[0] != x_fit[1]).nnz == 0
    assert x_test[0].nnz == 1 and x_test[1].nnz == 0
    top1_fit, _ = routing_features(fit, test, n_experts=6, features="top1")
    assert top1_fit.shape == (3, 3)  # experts 1, 3, 0 were someone's top-1


def windows(labels: np.ndarray, T: int = 8) -> LabelledWindows:
    labels = labels.reshape(-1, T).astype(np.int8)
    return LabelledWindows(np.zeros_like(labels, dtype=np.int64), {"context": labels, "lexical": labels % 2}, 1)


def test_routing_that_encodes_the_category_scores_one_and_routing_that_ignores_it_scores_the_majority():
    rng = np.random.default_rng(0)
    E, n = 8, 4000
    y_fit, y_test = rng.integers(0, 4, n), rng.integers(0, 4, n)
    fit, test = windows(y_fit), windows(y_test)

    def encode(y):  # two layers: the category picks experts {2c, 2c+1}
        pair = np.stack([2 * y, 2 * y + 1], -1)
        return np.stack([pair, pair[:, ::-1]], 1).reshape(-1, 8, 2, 2)

    perfect = evaluate_routing(encode(y_fit), fit, encode(y_test), test, E)
    assert perfect.accuracy["context"] == 1.0 and perfect.top1_accuracy["context"] == [1.0, 1.0]
    assert perfect.nmi["context"] == pytest.approx([1.0, 1.0])
    assert perfect.load_cv == pytest.approx([0.0, 0.0], abs=0.05) and perfect.dead_experts == [0, 0]

    def noise(m):
        first = rng.integers(0, E, m)
        pair = np.stack([first, (first + 1 + rng.integers(0, E - 1, m)) % E], -1)  # two distinct random experts
        return pair[:, None].repeat(2, 1).reshape(-1, 8, 2, 2)

    blind = evaluate_routing(noise(n), fit, noise(n), test, E)
    majority = np.mean(y_test == np.bincount(y_fit).argmax())
    assert abs(blind.accuracy["context"] - majority) < 0.03 and max(blind.nmi["context"]) < 0.01
    assert blind.category_load.shape == (2, len(CONTEXT), E)
    assert np.allclose(blind.category_load[:, :4].sum(-1), 1.0)  # the four categories present


def test_balance_by_hand():
    routes = np.array([[[0, 1]], [[0, 2]], [[0, 1]]])  # one layer, 4 experts: loads [3, 2, 1, 0]
    cv, dead = balance(routes, 4)
    loads = np.array([3, 2, 1, 0])
    assert cv[0] == pytest.approx(loads.std() / loads.mean()) and dead.tolist() == [1]
    load = category_load(routes, np.array([0, 1, 1]), 2, 4)
    assert load[0, 0].tolist() == [0.5, 0.5, 0, 0] and load[0, 1].tolist() == [0.5, 0.25, 0.25, 0]


def test_nmi_ignores_label_names():
    assert nmi(np.array([0, 0, 1, 1]), np.array([5, 5, 3, 3])) == pytest.approx(1.0)


class _FakeGate(nn.Module):
    """Returns a fixed routing whose experts are not in weight order."""

    def forward(self, x):
        n = x.shape[0]
        return Routing(torch.zeros(n, 4), None, torch.tensor([[1, 3]] * n), torch.tensor([[0.2, 0.7]] * n))


class _FakeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module(), nn.Module()])
        self.model.layers[0].mlp = nn.Linear(2, 2)  # a dense layer: no gate, not captured
        self.model.layers[1].mlp = nn.Module()
        self.model.layers[1].mlp.gate = _FakeGate()
        self.anchor = nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.anchor.device

    def forward(self, ids):
        self.model.layers[1].mlp.gate(torch.zeros(ids.numel(), 2))


def test_capture_orders_experts_by_gate_weight():
    routes = capture_routing(_FakeModel(), np.zeros((3, 5), dtype=np.int64), batch_size=2)
    assert routes.shape == (3, 5, 1, 2) and (routes[..., 0] == 3).all() and (routes[..., 1] == 1).all()


def test_labelled_windows_line_up_with_their_tokens(corpus_dir, tokenizer_dir):
    from openglm.tokenizer import Tokenizer
    from openglm.train.data import load_documents

    tok = Tokenizer.from_checkpoint(tokenizer_dir)
    w = labelled_windows(load_documents(str(corpus_dir)), tok, seq_len=16, max_windows=40)
    assert w.ids.shape == (40, 16) and w.labels["context"].shape == (40, 16) and w.documents >= 3
    texts = [tok.decode([int(i)]) for i in w.ids.ravel()]
    context, lexical = w.labels["context"].ravel(), w.labels["lexical"].ravel()
    for text, c, lex in zip(texts, context, lexical):
        visible = text.lstrip()
        if visible.startswith("#"):
            assert CONTEXT[c] == "comment"
        if visible in ("def", "return", "import", "class"):
            assert LEXICAL[lex] == "keyword", text
        if not visible:
            assert CONTEXT[c] == "layout" and LEXICAL[lex] == "layout"
    assert {CONTEXT[c] for c in context} >= {"signature", "docstring", "control", "code", "call_args"}


def test_context_decided_counts_the_routes_the_context_term_changes():
    from openglm.model import GlmMoeDsaForCausalLM, ModelConfig
    from openglm.model.context_router import ContextRouter

    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny", router_context="gated", index_n_heads=16))
    ids = np.random.default_rng(0).integers(3, 384, (4, 24))
    assert context_decided(model, ids, capture_routing(model, ids)) == 0.0  # untrained: U = 0
    routers = [m for m in model.modules() if isinstance(m, ContextRouter)]
    with torch.no_grad():
        for m in routers:
            m.context_weight.normal_(0.0, 2.0)
    kept = [m.context_weight.clone() for m in routers]
    share = context_decided(model, ids, capture_routing(model, ids))
    assert 0.05 < share < 1.0
    assert all(torch.equal(m.context_weight, w) for m, w in zip(routers, kept))  # restored
