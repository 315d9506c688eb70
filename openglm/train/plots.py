"""PNG plots of a run, drawn from its metrics.jsonl: loss curves and the layer x expert load heatmap."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from openglm.train.telemetry import read_metrics
from openglm.util.files import write_atomic


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Write loss.png and expert_load.png into `run_dir`; returns the files written."""
    import matplotlib  # optional and slow to import: only when plotting

    matplotlib.use("Agg")  # no display on servers
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    written = []
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    if train or val:
        written.append(_plot_loss(train, val, run_dir / "loss.png"))
    loads = [r for r in train if r.get("expert_share")]
    if loads:
        written.append(_plot_expert_load(loads, run_dir / "expert_load.png"))
    return written


def _plot_loss(train: list[dict], val: list[dict], path: Path) -> Path:
    return _save(loss_figure(train, val), path)


def loss_figure(train: list[dict], val: list[dict]):
    """Left: the LM loss (next-token cross-entropy, the quantity validation measures) of training and validation,
    with the unigram baseline. Right: the other terms of the training objective, each on its own (the MTP layer's
    cross-entropy on token t+2, the routers' balance loss), and their weighted sum that training adds to the LM loss."""
    import matplotlib  # optional and slow to import: only when plotting

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    others = [r for r in train if "aux_loss" in r]
    fig, axes = plt.subplots(1, 2 if others else 1, figsize=(12 if others else 7, 4), squeeze=False)
    ax = axes[0, 0]
    if train:
        steps = [r["step"] for r in train]
        ax.plot(steps, [r.get("lm_loss", r["loss"]) for r in train], label="train LM loss", lw=1.2)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation LM loss")
    baseline = next((r["unigram_loss"] for r in val if "unigram_loss" in r), None)
    if baseline is not None:
        ax.axhline(baseline, ls="--", c="gray", label=f"unigram baseline ({baseline:.2f})")
    ax.set_title("language-model loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if others:
        ax = axes[0, 1]
        steps = [r["step"] for r in others]
        if any("mtp_loss" in r for r in others):
            ax.plot(steps, [r.get("mtp_loss", np.nan) for r in others], label="MTP loss (token t+2)", lw=1.2)
        ax.plot(steps, [r.get("balance_loss", r["aux_loss"]) for r in others], label="router balance loss", lw=1.2)
        ax.plot(steps, [r["aux_loss"] for r in others], ls=":", c="gray", label="added to the LM loss (weighted)")
        ax.set_title("other training terms")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig


def _plot_expert_load(loads: list[dict], path: Path) -> Path:
    """Snapshots (start, ..., end) of each layer's per-expert token share, plus load CV over time."""
    import matplotlib.pyplot as plt  # slow to import: only when plotting

    picks = sorted(set(np.linspace(0, len(loads) - 1, num=min(4, len(loads))).round().astype(int)))
    fig, axes = plt.subplots(1, len(picks) + 1, figsize=(3.2 * (len(picks) + 1), 3.6))
    vmax = max(float(np.max(loads[i]["expert_share"])) for i in picks)
    for ax, i in zip(axes, picks):
        share = np.asarray(loads[i]["expert_share"])
        im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_title(f"step {loads[i]['step']}")
        ax.set_xlabel("expert")
    axes[0].set_ylabel("MoE layer")
    fig.colorbar(im, ax=list(axes[:-1]), label="share of tokens")
    cv = np.asarray([r["expert_cv"] for r in loads])
    steps = [r["step"] for r in loads]
    for layer in range(cv.shape[1]):
        axes[-1].plot(steps, cv[:, layer], label=f"layer {layer}")
    axes[-1].set_title("load CV (std/mean)")
    axes[-1].set_xlabel("step")
    if cv.shape[1] <= 8:
        axes[-1].legend(fontsize=7)
    return _save(fig, path)


def plot_category_load(loads: dict[str, np.ndarray], categories: list[str], path: str | os.PathLike,
                       notes: dict[str, str] | None = None) -> Path:
    """Expert x category load: one row of panels per router (name -> [moe_layers, categories, experts], each row the
    share of a category's top-k picks per expert), one panel per MoE layer; `notes` adds a line under a row's name."""
    import matplotlib  # optional and slow to import: only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # slow to import: only when plotting

    names = list(loads)
    n_layers = max(v.shape[0] for v in loads.values())
    fig, axes = plt.subplots(len(names), n_layers, figsize=(2.2 * n_layers + 2.5, 2.9 * len(names)), squeeze=False,
                             layout="constrained")
    vmax = max(float(v.max()) for v in loads.values())
    for row, name in enumerate(names):
        for layer in range(n_layers):
            ax = axes[row, layer]
            im = ax.imshow(loads[name][layer], aspect="auto", cmap="viridis", vmin=0, vmax=vmax,
                           interpolation="nearest")
            if row == 0:
                ax.set_title(f"MoE layer {layer}", fontsize=9)
            if row == len(names) - 1:
                ax.set_xlabel("expert", fontsize=8)
            ax.set_yticks(range(len(categories)), categories if layer == 0 else [""] * len(categories), fontsize=7)
            n_experts = loads[name].shape[-1]
            ax.set_xticks(range(0, n_experts, max(1, n_experts // 4)))
            ax.tick_params(axis="x", labelsize=7)
        label = name + (f"\n{notes[name]}" if notes and name in notes else "")
        axes[row, 0].set_ylabel(label, fontsize=9)
    fig.colorbar(im, ax=axes.ravel().tolist(), label="share of the category's top-k picks", shrink=0.8)
    return _save(fig, Path(path))


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt  # slow to import: only when plotting

    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)
    return path
