"""PNG maps of simulated comparisons (matplotlib, headless); runs plot with workload.report."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ratio_map(
    path: str,
    title: str,
    x_labels: Sequence[str],
    y_labels: Sequence[str],
    ratios: Sequence[Sequence[float]],
    x_name: str,
    y_name: str,
) -> None:
    """A heat map of disaggregated / collocated goodput: above 1 (blue) disaggregation wins."""
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm

    fig, ax = plt.subplots(figsize=(1.1 * len(x_labels) + 2.5, 0.6 * len(y_labels) + 1.8))
    finite = [v for row in ratios for v in row if v == v and v not in (float("inf"),)]
    hi = max([2.0, *finite])
    im = ax.imshow(ratios, cmap="RdBu", norm=TwoSlopeNorm(1.0, 0.0, hi), aspect="auto")
    for i, row in enumerate(ratios):
        for j, v in enumerate(row):
            ax.text(j, i, "-" if v != v else f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(x_labels)), x_labels)
    ax.set_yticks(range(len(y_labels)), y_labels)
    ax.set_xlabel(x_name)
    ax.set_ylabel(y_name)
    ax.set_title("\n".join(textwrap.wrap(title, 56)), fontsize=9)
    fig.colorbar(im, ax=ax, label="goodput ratio disagg / collocated")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
