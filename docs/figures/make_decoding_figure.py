"""The heatmaps of docs/decoding.md: a 4-query chunk over 12 keys, causal, at three offsets.

python docs/figures/make_decoding_figure.py      # writes docs/figures/decoding-offsets.png
"""

from __future__ import annotations

import pathlib

import numpy as np

import multiattn
from multiattn.plot import show_heatmaps

HERE = pathlib.Path(__file__).parent


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    x = np.random.default_rng(0).normal(size=(1, 12, 8))
    found, titles = [], []
    for offset in (0, 4, 8):
        _, weights = multiattn.dot_product_attention(
            x[:, offset : offset + 4], x, x, causal=True, query_offset=offset, return_weights=True
        )
        found.append(weights[0])
        titles.append(f"query_offset={offset}")
    fig = show_heatmaps(
        np.stack(found)[None], xlabel="keys", ylabel="queries", titles=titles, figsize=(9, 2.5)
    )
    fig.savefig(HERE / "decoding-offsets.png", dpi=80)
    print(f"wrote {HERE / 'decoding-offsets.png'}")


if __name__ == "__main__":
    main()
