"""Heatmaps of attention weights, the equivalent of d2l's ``show_heatmaps``.

Needs matplotlib (``pip install matplotlib``).  Takes a numpy array or a tensor of any
backend.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ._registry import framework_of, get_backend


def as_numpy(tensor: Any) -> np.ndarray:
    """A numpy copy of a numpy array or of any backend's tensor."""
    name = framework_of(tensor)
    if name is None or name == "numpy":
        return np.array(tensor)
    return get_backend(name).to_numpy(tensor)


def show_heatmaps(
    matrices: Any,
    xlabel: str,
    ylabel: str,
    titles: Optional[Sequence[str]] = None,
    figsize: Optional[Tuple[float, float]] = None,
    cmap: str = "Reds",
    *,
    row_labels: Optional[Sequence[str]] = None,
    suptitle: Optional[str] = None,
):
    """Draw (rows, cols, queries, keys) weights as a grid of heatmaps; returns the Figure.

    d2l's signature; figsize=None sizes each panel to its matrix (about 0.4 inch a cell).
    row_labels names the rows of every panel (e.g. "sequence 0 (valid_len 2)"), suptitle
    heads the figure.  Ticks are the integer positions.  Save with ``fig.savefig(path)``.
    """
    try:
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("show_heatmaps needs matplotlib: pip install matplotlib") from err
    values = as_numpy(matrices)
    if values.ndim != 4:
        raise ValueError(f"matrices must be 4-D (rows, cols, queries, keys), got shape {tuple(values.shape)}")
    num_rows, num_cols, height, width = values.shape
    if titles is not None and len(titles) != num_cols:
        raise ValueError(f"titles must have one entry per column ({num_cols}), got {len(titles)}")
    if row_labels is not None and len(row_labels) != height:
        raise ValueError(f"row_labels must have one entry per matrix row ({height}), got {len(row_labels)}")
    if figsize is None:
        label_width = 0.08 * max((len(label) for label in row_labels or ()), default=2)
        figsize = (num_cols * (0.4 * width + 0.5) + label_width + 1.2, num_rows * (0.4 * height + 1.0) + 0.7)
    fig, axes = plt.subplots(
        num_rows, num_cols, figsize=figsize, sharex=True, sharey=True, squeeze=False, layout="constrained"
    )
    image: Any = None
    for i in range(num_rows):
        for j in range(num_cols):
            ax = axes[i, j]
            image = ax.imshow(values[i, j], cmap=cmap, vmin=0.0, vmax=max(1e-12, float(values.max())))
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            if row_labels is not None:
                ax.set_yticks(range(height), labels=row_labels)
            if i == num_rows - 1:
                ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel(ylabel)
            if titles is not None:
                ax.set_title(titles[j])
    fig.colorbar(image, ax=axes, shrink=0.8)
    if suptitle:
        fig.suptitle(suptitle)
    return fig
