"""Heatmaps of attention weights, the equivalent of d2l's ``show_heatmaps``.

Needs matplotlib (``pip install 'multiattn[plot]'``).  Takes a numpy array or
a tensor of any backend.
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
    figsize: Tuple[float, float] = (2.5, 2.5),
    cmap: str = "Reds",
):
    """Draw (rows, cols, queries, keys) weights as a grid of heatmaps; returns the Figure.

    Save it with ``fig.savefig("weights.png")``.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("show_heatmaps needs matplotlib: pip install 'multiattn[plot]'") from err
    values = as_numpy(matrices)
    if values.ndim != 4:
        raise ValueError(f"matrices must be 4-D (rows, cols, queries, keys), got shape {tuple(values.shape)}")
    num_rows, num_cols = values.shape[:2]
    if titles is not None and len(titles) != num_cols:
        raise ValueError(f"titles must have one entry per column ({num_cols}), got {len(titles)}")
    fig, axes = plt.subplots(num_rows, num_cols, figsize=figsize, sharex=True, sharey=True, squeeze=False)
    image: Any = None
    for i in range(num_rows):
        for j in range(num_cols):
            ax = axes[i, j]
            image = ax.imshow(values[i, j], cmap=cmap)
            if i == num_rows - 1:
                ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel(ylabel)
            if titles is not None:
                ax.set_title(titles[j])
    fig.colorbar(image, ax=axes, shrink=0.6)
    return fig
