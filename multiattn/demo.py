"""``multiattn demo``: the worked example of d2l 11.3 on one backend.

All keys are equal, so whatever the random queries and weights, the weights
are uniform over the valid positions and the outputs are
[[[2, 3, 4, 5]], [[10, 11, 12, 13]]] for both scoring functions.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ._registry import get_backend, selected_backend

VALID_LENS = (2, 6)


def _inference(layer: Any) -> Any:
    # torch/paddle/mlx/nnx/numpy layers have eval(); Keras and Gluon infer unless training.
    if hasattr(layer, "eval") and callable(layer.eval):
        layer.eval()
    return layer


def example_inputs(backend: Any, query_size: int, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    queries = backend.from_numpy(rng.normal(0, 1, (2, 1, query_size)), "float32")
    keys = backend.from_numpy(np.ones((2, 10, 2)), "float32")
    values = backend.from_numpy(np.repeat(np.arange(40, dtype=np.float32).reshape(1, 10, 4), 2, axis=0))
    valid_lens = backend.from_numpy(np.array(VALID_LENS))
    return queries, keys, values, valid_lens


def run_demo(name: Optional[str], out: Optional[str]) -> int:
    name = name or selected_backend()
    backend = get_backend(name)
    if not hasattr(backend, "AdditiveAttention"):
        raise ValueError(f"the {name} backend has no layer classes, which the demo runs; choose another")
    additive = _inference(backend.AdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1))
    dot = _inference(backend.DotProductAttention(dropout=0.5))
    outputs = {}
    for label, layer, query_size in (("AdditiveAttention", additive, 20), ("DotProductAttention", dot, 2)):
        result = backend.to_numpy(layer(*example_inputs(backend, query_size)))
        outputs[label] = result
        print(f"{name} {label}(...) ->\n{np.array2string(result, precision=4, suppress_small=True)}")
    expected = np.array([[[2, 3, 4, 5]], [[10, 11, 12, 13]]], dtype=np.float64)
    agree = all(np.allclose(r, expected, rtol=1e-5) for r in outputs.values())
    print("matches the books' output [[[2,3,4,5]],[[10,11,12,13]]]:", "yes" if agree else "NO")
    if out:
        from .plot import show_heatmaps

        weights = np.stack(
            [backend.to_numpy(additive.attention_weights), backend.to_numpy(dot.attention_weights)]
        )
        fig = show_heatmaps(
            weights.reshape(1, 2, 2, 10),  # one query per sequence: a panel's rows are the sequences
            xlabel="Keys",
            ylabel="Sequences",
            titles=["AdditiveAttention", "DotProductAttention"],
            row_labels=[f"sequence {i} (valid_len {n})" for i, n in enumerate(VALID_LENS)],
            suptitle=f"Attention weights of the worked example, {name} backend",
        )
        fig.savefig(out, dpi=100)
        print(f"attention weights heatmap saved to {out}")
    return 0 if agree else 1
