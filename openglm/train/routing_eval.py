"""How much a trained MoE's routing says about the code it routes: routing accuracy, normalised mutual information
and load balance on labelled Python (labels from `code_context`, never shown to the model).

Definitions (held-out = windows of validation-split documents; fit = windows of training-split documents):
- routing accuracy: the accuracy on held-out tokens of a classifier that predicts a token's category from its routing
  alone, fitted on fit-set tokens:
    all layers (the headline figure): a multinomial logistic regression (scikit-learn, L2, C=1) over, for every MoE
      layer, a one-hot of the token's top-k expert *set* (unordered), concatenated over layers;
    one layer, top-1: the lookup of the most frequent fit-set category of the token's top-1 expert (the expert with
      the largest gate weight) in that layer, the best any classifier of that one feature can do on the fit set.
  References on the same tokens: "majority" (always the most frequent fit-set category) and "token id" (the lookup
  of the token id: what the token alone, without context, says).
- NMI: the normalised mutual information (arithmetic normalisation) between the held-out tokens' categories and their
  top-1 experts, per MoE layer.
- balance: per MoE layer, the coefficient of variation (std / mean) of the experts' held-out loads (all top-k picks),
  and the number of dead experts (chosen by no held-out token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from openglm.train.code_context import CONTEXT, DOCUMENT_KINDS, LabelError, document_kind, token_labels
from openglm.train.telemetry import load_cv

LABEL_SETS = ("context", "lexical", "document")  # names of `LabelledWindows.labels`


@dataclass
class LabelledWindows:
    ids: np.ndarray  # [n, T] int64 token ids, each window from the start of a document's run of tokens
    labels: dict[str, np.ndarray]  # label set -> [n, T] int8 category per token (LABEL_SETS)
    documents: int  # documents the windows came from


def labelled_windows(docs, tokenizer, seq_len: int, max_windows: int, per_document: int = 16,
                     seed: int = 0) -> LabelledWindows:
    """Up to `max_windows` windows of `seq_len` tokens, at most `per_document` from each document (spread evenly
    over it, so module docstrings and imports are not over-represented), documents taken in a seeded random order;
    documents that do not parse are skipped."""
    order = np.random.default_rng(seed).permutation(len(docs))
    ids, labels, used = [], {name: [] for name in LABEL_SETS}, 0
    for i in order:
        if len(ids) >= max_windows:
            break
        doc = docs[i]
        enc = tokenizer.hf.encode(doc.text, add_special_tokens=False)
        chunks = len(enc.ids) // seq_len
        n = min(chunks, per_document, max_windows - len(ids))
        if n == 0:
            continue
        try:
            lab = token_labels(doc.text, enc.offsets[:chunks * seq_len])
        except LabelError:
            continue
        picks = np.unique(np.linspace(0, chunks - 1, n).round().astype(int))
        kind = DOCUMENT_KINDS.index(document_kind(doc.name, doc.text))
        ids.extend(np.asarray(enc.ids[:chunks * seq_len], dtype=np.int64).reshape(chunks, seq_len)[picks])
        labels["context"].extend(lab.context.reshape(chunks, seq_len)[picks])
        labels["lexical"].extend(lab.lexical.reshape(chunks, seq_len)[picks])
        labels["document"].extend(np.full((len(picks), seq_len), kind, dtype=np.int8))
        used += 1
    if not ids:
        raise ValueError("no labelled window: every document was shorter than one window or did not parse")
    return LabelledWindows(np.stack(ids), {k: np.stack(v) for k, v in labels.items()}, used)


@torch.no_grad()
def capture_routing(model, ids: np.ndarray, batch_size: int = 16, bf16: bool = False) -> np.ndarray:
    """Every token's experts in each MoE layer of the decoder (next-n layers excluded), largest gate weight first:
    [n, T, moe_layers, k] int16. Runs `model` in eval mode over ids [n, T] (bf16 autocast if asked, as in training)."""
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    captured: list[list[torch.Tensor]] = [[] for _ in gates]

    def hook(slot):
        def record(_module, _inputs, routing):
            order = routing.weights.argsort(dim=-1, descending=True)
            captured[slot].append(routing.indices.gather(-1, order).to(torch.int16))
        return record

    handles = [g.register_forward_hook(hook(i)) for i, g in enumerate(gates)]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(ids), batch_size):
            batch = torch.from_numpy(ids[start:start + batch_size]).to(model.device)
            with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=bf16):
                model(batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    n, T = ids.shape
    layers = [torch.cat(c).view(n, T, -1) for c in captured]
    return torch.stack(layers, dim=2).numpy()


@torch.no_grad()
def context_decided(model, ids: np.ndarray, routes: np.ndarray, batch_size: int = 16, bf16: bool = False) -> float:
    """The share of (token, MoE layer) top-k sets in `routes` (captured from `model` over ids) that change when every
    context-aware router's context term is switched off (U = 0): how much of the routing the context decides."""
    from openglm.model.context_router import ContextRouter  # only context-aware models are asked

    saved = [(m, m.context_weight.detach().clone()) for m in model.modules() if isinstance(m, ContextRouter)]
    try:
        for m, _ in saved:
            m.context_weight.zero_()
        without = capture_routing(model, ids, batch_size, bf16)
    finally:
        for m, w in saved:
            m.context_weight.copy_(w)
    return float(np.mean((np.sort(routes, -1) != np.sort(without, -1)).any(-1)))


def routing_features(fit_routes: np.ndarray, test_routes: np.ndarray, n_experts: int, features: str = "sets",
                     layers=None):
    """Sparse one-hot features (fit [n, d], test [m, d]) of routes [n, moe_layers, k] (see the module docstring): per
    layer, one column per top-1 expert or per top-k set seen in the fit routes (an unseen set has no column)."""
    from scipy import sparse  # with scikit-learn: only for the evaluation

    def codes(routes):
        routes = routes if layers is None else routes[:, list(layers)]
        if features == "top1":
            return routes[:, :, 0].astype(np.int64)
        if features != "sets":
            raise ValueError(f"features={features!r}: use 'sets' or 'top1'")
        k = routes.shape[2]
        if k * np.log2(n_experts) >= 62:
            raise ValueError(f"top-{k} sets of {n_experts} experts do not fit one int64 code")
        return (np.sort(routes.astype(np.int64), axis=-1) * n_experts ** np.arange(k)).sum(-1)  # one per set

    fit, test = codes(fit_routes), codes(test_routes)
    columns, width = [], 0
    for layer in range(fit.shape[1]):
        seen = np.unique(fit[:, layer])
        columns.append((seen, width))
        width += len(seen)

    def one_hots(c):
        rows, cols = [], []
        for layer, (seen, offset) in enumerate(columns):
            at = np.searchsorted(seen, c[:, layer]).clip(max=len(seen) - 1)
            known = seen[at] == c[:, layer]
            rows.append(np.nonzero(known)[0])
            cols.append(offset + at[known])
        rows, cols = np.concatenate(rows), np.concatenate(cols)
        return sparse.csr_matrix((np.ones(len(rows), dtype=np.float32), (rows, cols)), shape=(len(c), width))

    return one_hots(fit), one_hots(test)


def classifier_accuracy(x_fit, y_fit: np.ndarray, x_test, y_test: np.ndarray) -> float:
    """Held-out accuracy of a multinomial logistic regression (L2, C=1) fitted on (x_fit, y_fit)."""
    from sklearn.linear_model import LogisticRegression  # optional: only for the evaluation

    if len(np.unique(y_fit)) < 2:
        return float(np.mean(y_test == y_fit[0]))
    clf = LogisticRegression(C=1.0, max_iter=1000)
    clf.fit(x_fit, y_fit)
    return float(np.mean(clf.predict(x_test) == y_test))


def lookup_accuracy(f_fit: np.ndarray, y_fit: np.ndarray, f_test: np.ndarray, y_test: np.ndarray) -> float:
    """Held-out accuracy of predicting, for each value of one discrete feature, its most frequent fit-set category
    (a value unseen in the fit set: the most frequent category overall)."""
    values, inverse = np.unique(f_fit, return_inverse=True)
    n_classes = int(max(y_fit.max(), y_test.max())) + 1
    table = np.zeros((len(values), n_classes), dtype=np.int64)
    np.add.at(table, (inverse, y_fit.astype(np.int64)), 1)
    best = table.argmax(1)
    at = np.searchsorted(values, f_test).clip(max=len(values) - 1)
    pred = np.where(values[at] == f_test, best[at], np.bincount(y_fit.astype(np.int64)).argmax())
    return float(np.mean(pred == y_test))


def majority_accuracy(y_fit: np.ndarray, y_test: np.ndarray) -> float:
    return float(np.mean(y_test == np.bincount(y_fit).argmax()))


def nmi(labels: np.ndarray, experts: np.ndarray) -> float:
    from sklearn.metrics import normalized_mutual_info_score  # the evaluation's NMI

    return float(normalized_mutual_info_score(labels, experts))


def balance(routes: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(load CV per MoE layer, dead experts per MoE layer) of routes [n, moe_layers, k]."""
    counts = np.stack([np.bincount(routes[:, layer].ravel().astype(np.int64), minlength=n_experts)
                       for layer in range(routes.shape[1])])
    return load_cv(counts), (counts == 0).sum(axis=1)


def category_load(routes: np.ndarray, labels: np.ndarray, n_categories: int, n_experts: int) -> np.ndarray:
    """[moe_layers, categories, experts]: the share of each category's top-k picks that went to each expert (rows sum
    to 1; a category with no token is all zero)."""
    n, L, k = routes.shape
    out = np.zeros((L, n_categories, n_experts))
    for layer in range(L):
        np.add.at(out[layer], (np.repeat(labels, k), routes[:, layer].ravel().astype(np.int64)), 1.0)
    total = out.sum(-1, keepdims=True)
    return np.divide(out, total, out=np.zeros_like(out), where=total > 0)


@dataclass
class RoutingReport:
    accuracy: dict[str, float]  # label set -> routing accuracy (top-k sets, all MoE layers)
    top1_accuracy: dict[str, list[float]]  # label set -> routing accuracy from each layer's top-1 expert alone
    nmi: dict[str, list[float]]  # label set -> NMI(category, top-1 expert) per MoE layer
    load_cv: list[float]  # per MoE layer
    dead_experts: list[int]  # per MoE layer
    category_load: np.ndarray  # [moe_layers, len(CONTEXT), experts] on held-out tokens

    def summary(self) -> dict:
        """Scalars: the per-layer figures averaged over layers, dead experts summed."""
        out = {f"acc_{k}": v for k, v in self.accuracy.items()}
        out |= {f"top1_acc_{k}": float(np.mean(v)) for k, v in self.top1_accuracy.items()}
        out |= {f"nmi_{k}": float(np.mean(v)) for k, v in self.nmi.items()}
        return out | {"load_cv": float(np.mean(self.load_cv)), "dead_experts": int(np.sum(self.dead_experts))}


def evaluate_routing(fit_routes: np.ndarray, fit: LabelledWindows, test_routes: np.ndarray, test: LabelledWindows,
                     n_experts: int, label_sets=("context", "lexical")) -> RoutingReport:
    """Every figure of the module docstring, from captured routes ([n, T, moe_layers, k]) of both window sets."""
    fr, tr = fit_routes.reshape(-1, *fit_routes.shape[2:]), test_routes.reshape(-1, *test_routes.shape[2:])
    L = fr.shape[1]
    acc, top1, mi = {}, {}, {}
    for name in label_sets:
        yf, yt = fit.labels[name].ravel(), test.labels[name].ravel()
        xf, xt = routing_features(fr, tr, n_experts)
        acc[name] = classifier_accuracy(xf, yf, xt, yt)
        top1[name] = [lookup_accuracy(fr[:, layer, 0], yf, tr[:, layer, 0], yt) for layer in range(L)]
        mi[name] = [nmi(yt, tr[:, layer, 0]) for layer in range(L)]
    cv, dead = balance(tr, n_experts)
    load = category_load(tr, test.labels["context"].ravel(), len(CONTEXT), n_experts)
    return RoutingReport(acc, top1, mi, cv.tolist(), dead.tolist(), load)


def reference_accuracies(fit: LabelledWindows, test: LabelledWindows,
                         label_sets=("context", "lexical")) -> dict[str, dict[str, float]]:
    """Router-independent references per label set: 'majority' and 'token id' (see the module docstring)."""
    out = {}
    for name in label_sets:
        yf, yt = fit.labels[name].ravel(), test.labels[name].ravel()
        out[name] = {"majority": majority_accuracy(yf, yt),
                     "token id": lookup_accuracy(fit.ids.ravel(), yf, test.ids.ravel(), yt)}
    return out
