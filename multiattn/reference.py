"""A float64 numpy reference with analytic gradients, for ``multiattn check``.

Written from the formulas of d2l 11.3 and their derivatives, independently of
``multiattn.core`` (it shares no code with the backends it judges).  Every
function returns a dict: ``out``, ``weights`` and, given a cotangent G,
``grads`` of sum(out * G) with respect to each input.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

Array = np.ndarray


def length_mask(shape: tuple, valid_lens: Optional[Array]) -> Array:
    """True where position j of a (B, Q, K) score tensor is below its valid length."""
    if valid_lens is None:
        return np.ones(shape, dtype=bool)
    lens = np.asarray(valid_lens, dtype=np.float64)
    lens = lens[:, None, None] if lens.ndim == 1 else lens[:, :, None]
    return np.arange(shape[-1]) < lens


def masked_softmax(X: Array, valid_lens: Optional[Array] = None) -> Array:
    X = np.asarray(X, dtype=np.float64)
    mask = length_mask(X.shape, valid_lens) if valid_lens is not None else np.ones(X.shape, bool)
    peak = np.max(np.where(mask, X, -np.inf), axis=-1, keepdims=True, initial=-np.inf)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.where(mask, np.exp(np.where(mask, X, 0.0) - peak), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def _softmax_backward(weights: Array, d_weights: Array) -> Array:
    return weights * (d_weights - (d_weights * weights).sum(axis=-1, keepdims=True))


def masked_softmax_case(
    X: Array, valid_lens: Optional[Array] = None, cotangent: Optional[Array] = None
) -> dict:
    weights = masked_softmax(X, valid_lens)
    result: dict = {"out": weights, "weights": weights}
    if cotangent is not None:
        result["grads"] = {"X": _softmax_backward(weights, np.asarray(cotangent, np.float64))}
    return result


def dot_product_attention(
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Optional[Array] = None,
    cotangent: Optional[Array] = None,
) -> dict:
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (queries, keys, values))
    scale = 1.0 / math.sqrt(q.shape[-1])
    weights = masked_softmax(np.einsum("bqd,bkd->bqk", q, k) * scale, valid_lens)
    result: dict = {"out": weights @ v, "weights": weights}
    if cotangent is not None:
        g = np.asarray(cotangent, dtype=np.float64)
        d_scores = _softmax_backward(weights, g @ np.swapaxes(v, 1, 2))
        result["grads"] = {
            "queries": d_scores @ k * scale,
            "keys": np.swapaxes(d_scores, 1, 2) @ q * scale,
            "values": np.swapaxes(weights, 1, 2) @ g,
        }
    return result


def additive_attention(
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Optional[Array],
    W_q: Array,
    W_k: Array,
    w_v: Array,
    cotangent: Optional[Array] = None,
) -> dict:
    q, k, v, W_q, W_k, w_v = (np.asarray(a, dtype=np.float64) for a in (queries, keys, values, W_q, W_k, w_v))
    hidden_q, hidden_k = q @ W_q.T, k @ W_k.T  # (B, Q, h), (B, K, h)
    features = np.tanh(hidden_q[:, :, None, :] + hidden_k[:, None, :, :])  # (B, Q, K, h)
    weights = masked_softmax(features @ w_v, valid_lens)
    result: dict = {"out": weights @ v, "weights": weights}
    if cotangent is not None:
        g = np.asarray(cotangent, dtype=np.float64)
        d_scores = _softmax_backward(weights, g @ np.swapaxes(v, 1, 2))  # (B, Q, K)
        d_pre = d_scores[..., None] * w_v * (1.0 - features**2)  # through w_v and tanh
        d_hidden_q, d_hidden_k = d_pre.sum(axis=2), d_pre.sum(axis=1)
        result["grads"] = {
            "queries": d_hidden_q @ W_q,
            "keys": d_hidden_k @ W_k,
            "values": np.swapaxes(weights, 1, 2) @ g,
            "W_q": np.einsum("bqh,bqi->hi", d_hidden_q, q),
            "W_k": np.einsum("bkh,bki->hi", d_hidden_k, k),
            "w_v": np.einsum("bqk,bqkh->h", d_scores, features),
        }
    return result
