"""The report's figures, drawn with matplotlib's Agg backend (no display) and returned as PNG bytes.

Each function takes plain series ({label: (x, y)}) so the report decides what goes in; colours are fixed per stack
name so before/after look the same in every figure.
"""
from __future__ import annotations

import io

COLORS = {"stock": "#7f7f7f", "hf_sdpa": "#7f7f7f", "novatune": "#d62728", "liger-peer": "#1f77b4",
          "varlen_liger": "#1f77b4", "flex_liger": "#17becf", "hf_flex": "#9467bd"}
CATEGORY_COLORS = {"GEMM": "#4c72b0", "attention": "#dd8452", "norms": "#55a868", "activation": "#c44e52",
                   "RoPE": "#8172b3", "loss": "#937860", "optimizer": "#da8bc3", "copies": "#8c8c8c",
                   "other": "#ccb974"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # before pyplot: a headless machine has no display
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def _color(label: str, i: int) -> str:
    for name, c in COLORS.items():
        if label == name or label.startswith(name + " "):
            return c
    return f"C{i % 10}"


def line_plot(series: dict[str, tuple[list, list]], title: str, ylabel: str, xlabel: str = "optimizer step",
              marker_warm: int | None = None) -> bytes:
    """One line per series; marker_warm draws a dashed line after the last warm-up step."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for i, (label, (x, y)) in enumerate(series.items()):
        ax.plot(x, y, marker="o", markersize=3, linewidth=1.6, label=label, color=_color(label, i))
    if marker_warm:
        ax.axvline(marker_warm + 0.5, color="#999999", linestyle="--", linewidth=1)
        ax.text(marker_warm + 0.55, ax.get_ylim()[0], " timed steps ->", va="bottom", fontsize=8, color="#666666")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def bar_plot(values: dict[str, float], title: str, xlabel: str) -> bytes:
    """Horizontal bars (tokens/s per stack), value printed at the end of each bar."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 0.5 + 0.45 * len(values)))
    labels = list(values)
    ax.barh(labels, [values[k] for k in labels], color=[_color(k, i) for i, k in enumerate(labels)])
    for i, k in enumerate(labels):
        ax.text(values[k], i, f" {values[k]:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_xlim(0, max(values.values()) * 1.18)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def stacked_breakdown(per_trace: dict[str, dict[str, float]], title: str, categories,
                      xlabel: str = "GPU time (ms)") -> bytes:
    """One horizontal bar per trace, split by category (ms)."""
    plt = _plt()
    names = list(per_trace)
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.55 * len(names)))
    left = [0.0] * len(names)
    for cat in categories:
        vals = [per_trace[n].get(cat, 0.0) for n in names]
        if not any(vals):
            continue
        ax.barh(names, vals, left=left, label=cat, color=CATEGORY_COLORS.get(cat))
        left = [a + b for a, b in zip(left, vals)]
    for i, total in enumerate(left):
        ax.text(total, i, f" {total:,.1f} ms", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(left) * 1.2 if max(left) > 0 else 1)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.28 - 0.02 * len(names)))
    return _png(fig)
