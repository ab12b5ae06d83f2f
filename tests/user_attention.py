"""Attention functions as a user might write them, for `check --against` and
`multiattn.testing`: multiattn's own (which must pass), and three with known faults."""

from __future__ import annotations

import math

import numpy as np

import multiattn


def ours_masked_softmax(X, valid_lens, **masks):
    return multiattn.masked_softmax(X, valid_lens, **masks)


def ours_dot_product(queries, keys, values, valid_lens, **masks):
    return multiattn.dot_product_attention(queries, keys, values, valid_lens, return_weights=True, **masks)


def ours_additive(queries, keys, values, valid_lens, *, W_q, W_k, w_v, **masks):
    return multiattn.additive_attention(queries, keys, values, valid_lens, W_q=W_q, W_k=W_k, w_v=w_v, **masks)


def ours_multi_head(
    queries, keys, values, valid_lens, *, weights, num_heads, attention_mask=None, causal=False
):
    return multiattn.multi_head_attention(
        queries, keys, values, valid_lens, weights=weights, num_heads=num_heads,
        attention_mask=attention_mask, causal=causal, return_weights=True,
    )  # fmt: skip


def _softmax(X):
    e = np.exp(X - X.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def d2l_masked_softmax(X, valid_lens):
    """d2l's masked_softmax in numpy (on a copy): -1e6 where masked, so a fully masked row is
    uniform (and NaN in float16, where -1e6 is -inf)."""
    if valid_lens is None:
        return _softmax(X)
    shape = X.shape
    lens = np.repeat(valid_lens, shape[1]) if valid_lens.ndim == 1 else valid_lens.reshape(-1)
    flat = X.reshape(-1, shape[-1]).copy()
    flat[~(np.arange(shape[-1])[None, :] < lens[:, None])] = -1e6
    return _softmax(flat.reshape(shape))


def writes_its_input(X, valid_lens, **masks):
    """Right values, but X is used as scratch space."""
    weights = multiattn.masked_softmax(X, valid_lens, **masks)
    X[...] = weights
    return weights


def forgets_the_scale(queries, keys, values, valid_lens, **masks):
    """Dot-product attention without the 1/sqrt(d)."""
    scores = queries @ np.swapaxes(keys, 1, 2)
    weights = multiattn.masked_softmax(scores, valid_lens, **masks)
    return weights @ values, weights


def scaled_right(queries, keys, values, valid_lens, **masks):
    """The same, with the scale: agrees (lengths and masks through masked_softmax)."""
    scores = queries @ np.swapaxes(keys, 1, 2) / math.sqrt(queries.shape[-1])
    weights = multiattn.masked_softmax(scores, valid_lens, **masks)
    return multiattn.masked_softmax(scores, valid_lens, **masks) @ values, weights


not_a_function = 3
