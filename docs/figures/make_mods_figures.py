"""The heatmaps of docs/mods.md: the weights of one sequence under each ready-made mask.

python docs/figures/make_mods_figures.py      # writes docs/figures/mods-*.png
"""

from __future__ import annotations

import pathlib

import numpy as np

import multiattn
from multiattn import mods
from multiattn.plot import show_heatmaps

N = 12
HERE = pathlib.Path(__file__).parent
MASKS = {
    "sliding-window": ("sliding_window(4)", mods.sliding_window(4)),
    "prefix-lm": ("prefix_lm(5)", mods.prefix_lm(5)),
    "document": (
        "document(ids), documents of 5, 4 and 3",
        mods.document(np.repeat([[0, 1, 2]], [5, 4, 3], axis=1)),
    ),
}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    x = np.random.default_rng(0).normal(size=(1, N, 8))
    for name, (title, mask_mod) in MASKS.items():
        _, weights = multiattn.dot_product_attention(x, x, x, mask_mod=mask_mod, return_weights=True)
        fig = show_heatmaps(weights[None], xlabel="keys", ylabel="queries", titles=[title])
        fig.savefig(HERE / f"mods-{name}.png", dpi=80)
        print(f"wrote {HERE / f'mods-{name}.png'}")


if __name__ == "__main__":
    main()
