"""Independent float64 reference, written from the formulas of d2l 11.3 with loops.

It never imports multiattn: comparing the library with itself would prove nothing.
"""

from __future__ import annotations

import math

import numpy as np


def valid_count(length: float, n_keys: int) -> int:
    """How many positions j in range(n_keys) satisfy j < length (lengths are clipped)."""
    return sum(1 for j in range(n_keys) if j < length)


def softmax_row(row: np.ndarray) -> np.ndarray:
    row = np.asarray(row, dtype=np.float64)
    if row.size == 0:
        return row.copy()
    e = np.exp(row - row.max())
    return e / e.sum()


def masked_softmax(X, valid_lens=None) -> np.ndarray:
    X = np.asarray(X, dtype=np.float64)
    if valid_lens is None:
        out = np.zeros_like(X)
        for row in np.ndindex(X.shape[:-1]):
            out[row] = softmax_row(X[row])
        return out
    lens = np.asarray(valid_lens, dtype=np.float64)
    B, Q, K = X.shape
    out = np.zeros_like(X)
    for b in range(B):
        for i in range(Q):
            length = lens[b] if lens.ndim == 1 else lens[b, i]
            n = valid_count(length, K)
            if n:
                out[b, i, :n] = softmax_row(X[b, i, :n])
    return out


def pool(weights: np.ndarray, values) -> np.ndarray:
    """sum_j alpha_ij v_j for every batch element and query."""
    values = np.asarray(values, dtype=np.float64)
    B, Q, K = weights.shape
    out = np.zeros((B, Q, values.shape[-1]))
    for b in range(B):
        for i in range(Q):
            for j in range(K):
                out[b, i] += weights[b, i, j] * values[b, j]
    return out


def dot_product_scores(queries, keys) -> np.ndarray:
    q = np.asarray(queries, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    B, Q, d = q.shape
    K = k.shape[1]
    scores = np.zeros((B, Q, K))
    for b in range(B):
        for i in range(Q):
            for j in range(K):
                scores[b, i, j] = float(np.dot(q[b, i], k[b, j])) / math.sqrt(d)
    return scores


def additive_scores(queries, keys, W_q, W_k, w_v) -> np.ndarray:
    q = np.asarray(queries, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    W_q, W_k, w_v = (np.asarray(w, dtype=np.float64) for w in (W_q, W_k, w_v))
    B, Q, _ = q.shape
    K = k.shape[1]
    scores = np.zeros((B, Q, K))
    for b in range(B):
        for i in range(Q):
            for j in range(K):
                scores[b, i, j] = w_v @ np.tanh(W_q @ q[b, i] + W_k @ k[b, j])
    return scores


def dot_product_attention(queries, keys, values, valid_lens=None):
    """(output, weights) of softmax(Q K^T / sqrt(d)) V."""
    weights = masked_softmax(dot_product_scores(queries, keys), valid_lens)
    return pool(weights, values), weights


def additive_attention(queries, keys, values, valid_lens, W_q, W_k, w_v):
    weights = masked_softmax(additive_scores(queries, keys, W_q, W_k, w_v), valid_lens)
    return pool(weights, values), weights
