"""Plot helpers every perf report shares: matplotlib without a display, a linear sequence-length axis labelled in
tokens, the value written on each point, a 1x line, and legends placed outside the data."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tokens_label(T: int) -> str:
    return f"{T // 1024}k" if T >= 1024 and T % 1024 == 0 else str(T)


def seq_len_axis(ax, seq_lens: list[int], label: str = "sequence length (tokens)") -> None:
    """A linear x axis with a tick at every measured length."""
    ax.set_xticks(seq_lens)
    ax.set_xticklabels([tokens_label(t) for t in seq_lens])
    if seq_lens:
        pad = 0.06 * (max(seq_lens) - min(seq_lens) or max(seq_lens))
        ax.set_xlim(min(seq_lens) - pad, max(seq_lens) + pad)
    ax.set_xlabel(label)
    ax.grid(True, alpha=0.3)


def annotate_points(ax, xs, ys, labels, offset_points: int = 8, color: str | None = None, fontsize: int = 7) -> None:
    """Write each label next to its point (offset_points above, or below when negative)."""
    for x, y, text in zip(xs, ys, labels):
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(0, offset_points), ha="center",
                    va="bottom" if offset_points >= 0 else "top", fontsize=fontsize, color=color)


def unity_line(ax, label: str) -> None:
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label=label)


def legend_outside(ax, **kwargs) -> None:
    """A legend to the right of the axes, so it covers no point."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)


def legend_below(ax, ncol: int = 2, **kwargs) -> None:
    """A legend under the axes (below the x label), so it covers no point and no neighbouring panel."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol, frameon=False, **kwargs)


def save(fig, path: Path, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
