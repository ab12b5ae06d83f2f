"""The math of d2l section 11.3, once, over the required primitives of ``protocol.Ops``.

Each function is the book's formula and nothing else: no argument checks
(``checks``), no fast paths (``strategies``, which pick one per call and fall
back to these functions; the tests hold every strategy to them and to an
independent float64 reference).  Shapes: queries (B, Q, q), keys (B, K, k),
values (B, K, v), scores and weights (B, Q, K), valid_lens (B,) or (B, Q).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from .protocol import Ops, Tensor

Dropout = Optional[Callable[[Tensor], Tensor]]


def masked_softmax(ops: Ops, X: Tensor, valid_lens: Tensor = None) -> Tensor:
    """softmax over the last axis with the positions j >= valid_len weighted exactly 0:
    w_ij = exp(x_ij) / sum_{l < len_i} exp(x_il) for j < len_i, else 0.

    The fill is the dtype's lowest finite value, not -inf (d2l: -1e6), so a fully
    masked row stays free of NaN; the second ``where`` makes it all zeros."""
    if valid_lens is None:
        return ops.softmax(X)
    mask = ops.length_mask(X, valid_lens)  # (B, 1|Q, K), broadcast over the queries
    weights = ops.softmax(ops.where(mask, X, ops.lowest(X)))
    return ops.where(mask, weights, 0.0)


def visible_values(ops: Ops, values: Tensor, mask: Tensor) -> Tensor:
    """values (B, K, v) with the rows no query may see (mask (B, 1|Q, K) false for all of
    them) set to 0, so that a NaN or inf in the padding cannot reach the output as 0 * NaN."""
    if ops.shape(mask)[1] != 1:  # per-query lengths: a key is used if any query sees it
        mask = ops.any(mask, 1)
    return ops.where(ops.matrix_transpose(mask), values, 0.0)  # (B, 1, K) -> (B, K, 1)


def attention_pooling(ops: Ops, weights: Tensor, values: Tensor, dropout: Dropout = None) -> Tensor:
    """f(q, (k_1, v_1), ..., (k_m, v_m)) = sum_i alpha(q, k_i) v_i, dropout on the weights."""
    return ops.matmul(weights if dropout is None else dropout(weights), values)


def dot_product_scores(ops: Ops, queries: Tensor, keys: Tensor) -> Tensor:
    """a(q, k) = q^T k / sqrt(d), d the query width: (B, Q, d), (B, K, d) -> (B, Q, K)."""
    return ops.matmul_t(queries, keys) * (1.0 / math.sqrt(ops.shape(queries)[-1]))


def additive_scores(ops: Ops, q_hidden: Tensor, k_hidden: Tensor, w_v: Tensor) -> Tensor:
    """a(q, k) = w_v^T tanh(W_q q + W_k k) from the projections W_q q (B, Q, h) and
    W_k k (B, K, h): the features (B, Q, K, h) summed by broadcasting, as d2l does."""
    features = ops.tanh(ops.expand_dims(q_hidden, 2) + ops.expand_dims(k_hidden, 1))
    return ops.matmul(features, w_v)


def attend(
    ops: Ops, scores: Tensor, values: Tensor, valid_lens: Tensor = None, dropout: Dropout = None
) -> tuple[Tensor, Tensor]:
    """(attention pooling of values by masked_softmax(scores), the weights before dropout)."""
    weights = masked_softmax(ops, scores, valid_lens)
    if valid_lens is not None:
        values = visible_values(ops, values, ops.length_mask(values, valid_lens, axis=1))
    return attention_pooling(ops, weights, values, dropout), weights


def dot_product_attention(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor = None,
    dropout: Dropout = None,
) -> tuple[Tensor, Tensor]:
    """softmax(Q K^T / sqrt(d)) V, masked: (output (B, Q, v), weights (B, Q, K))."""
    return attend(ops, dot_product_scores(ops, queries, keys), values, valid_lens, dropout)


def additive_attention(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor = None,
    *,
    W_q: Tensor,
    W_k: Tensor,
    w_v: Tensor,
    dropout: Dropout = None,
) -> tuple[Tensor, Tensor]:
    """Additive attention, canonical weights W_q (h, q), W_k (h, k), w_v (h,), no biases."""
    scores = additive_scores(ops, ops.matmul_t(queries, W_q), ops.matmul_t(keys, W_k), w_v)
    return attend(ops, scores, values, valid_lens, dropout)
