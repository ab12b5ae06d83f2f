"""The math of d2l sections 11.3 and 11.5, once, over the required primitives of ``protocol.Ops``.

Each function is the book's formula and nothing else: no argument checks
(``checks``), no fast paths (``strategies``, which pick one per call and fall
back to these functions; the tests hold every strategy to them and to an
independent float64 reference).  Shapes: queries (B, [H,] Q, q), keys (B, [H,] K, k),
values (B, [H,] K, v), scores and weights (B, [H,] Q, K), valid_lens (B,) or (B, Q),
attention_mask boolean (True: may attend), broadcastable to the scores.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Optional

from .protocol import Ops, Tensor

Dropout = Optional[Callable[[Tensor], Tensor]]


def visibility(
    ops: Ops, scores: Tensor, valid_lens: Tensor = None, attention_mask: Tensor = None, causal: bool = False
) -> Optional[Tensor]:
    """Which key each query may see, for scores (B, [H,] Q, K): j < valid_len, attention_mask
    and (causal) j <= i, all of them (AND); None where every key is visible."""
    shape = ops.shape(scores)
    masks = [] if valid_lens is None else [ops.length_mask(scores, valid_lens)]  # (B, 1|Q, K)
    if attention_mask is not None:
        masks.append(attention_mask)
    if causal:
        masks.append(ops.causal_mask(shape[-2], shape[-1], scores))
    return all_of(ops, masks, len(shape))


def all_of(ops: Ops, masks: list, rank: int) -> Optional[Tensor]:
    """The AND of boolean masks, each brought to the scores' rank: a 3-D mask against 4-D
    scores is (B, Q, K), shared by the heads; smaller masks broadcast from the right."""
    combined = None
    for mask in masks:
        mask_rank = len(ops.shape(mask))
        if mask_rank == 3 and rank == 4:
            mask, mask_rank = ops.expand_dims(mask, 1), 4
        while mask_rank < rank:
            mask, mask_rank = ops.expand_dims(mask, 0), mask_rank + 1
        combined = mask if combined is None else ops.logical_and(combined, mask)
    return combined


def masked_softmax(
    ops: Ops, X: Tensor, valid_lens: Tensor = None, attention_mask: Tensor = None, causal: bool = False
) -> Tensor:
    """softmax over the last axis with the hidden positions weighted exactly 0:
    w_ij = exp(x_ij) / sum_{l visible} exp(x_il) for j visible (``visibility``), else 0.

    The fill is the dtype's lowest finite value, not -inf (d2l: -1e6), so a fully
    masked row stays free of NaN; the second ``where`` makes it all zeros."""
    mask = visibility(ops, X, valid_lens, attention_mask, causal)
    return softmax_where(ops, X, mask)


def softmax_where(ops: Ops, X: Tensor, mask: Optional[Tensor]) -> Tensor:
    """``masked_softmax`` with the visibility mask given (None: all visible)."""
    if mask is None:
        return ops.softmax(X)
    weights = ops.softmax(ops.where(mask, X, ops.lowest(X)))
    return ops.where(mask, weights, 0.0)


def visible_values(ops: Ops, values: Tensor, mask: Tensor) -> Tensor:
    """values (B, [H,] K, v) with the rows no query may see (mask (..., 1|Q, K) false for all
    of them) set to 0, so that a NaN or inf in the padding cannot reach the output as 0 * NaN."""
    if ops.shape(mask)[-2] != 1:  # per-query visibility: a key is used if any query sees it
        mask = ops.any(mask, -2)
    return ops.where(ops.matrix_transpose(mask), values, 0.0)  # (..., 1, K) -> (..., K, 1)


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
    ops: Ops, scores: Tensor, values: Tensor, mask: Optional[Tensor] = None, dropout: Dropout = None
) -> tuple[Tensor, Tensor]:
    """(attention pooling of values by the masked softmax of scores, the weights before
    dropout); mask from ``visibility`` (None: every key visible)."""
    weights = softmax_where(ops, scores, mask)
    if mask is not None:
        values = visible_values(ops, values, mask)
    return attention_pooling(ops, weights, values, dropout), weights


def dot_product_attention(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor = None,
    dropout: Dropout = None,
    attention_mask: Tensor = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """softmax(Q K^T / sqrt(d)) V, masked: (output (B, [H,] Q, v), weights (B, [H,] Q, K))."""
    scores = dot_product_scores(ops, queries, keys)
    return attend(ops, scores, values, visibility(ops, scores, valid_lens, attention_mask, causal), dropout)


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
    attention_mask: Tensor = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """Additive attention, canonical weights W_q (h, q), W_k (h, k), w_v (h,), no biases."""
    scores = additive_scores(ops, ops.matmul_t(queries, W_q), ops.matmul_t(keys, W_k), w_v)
    return attend(ops, scores, values, visibility(ops, scores, valid_lens, attention_mask, causal), dropout)


def linear(ops: Ops, x: Tensor, W: Tensor, b: Tensor = None) -> Tensor:
    """W x + b for every row of x: x (..., in), W (out, in), b (out,) or None."""
    y = ops.matmul_t(x, W)
    return y if b is None else y + b


def multi_head_attention(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor = None,
    *,
    weights: Mapping[str, Tensor],
    num_heads: int,
    dropout: Dropout = None,
    attention_mask: Tensor = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """d2l 11.5: h_i = f(W_q^(i) q, W_k^(i) k, W_v^(i) v) per head i, scaled dot-product
    attention on the i-th group of num_hiddens / num_heads columns; out = W_o [h_1, ..., h_H].
    weights: canonical W_q (h, q), W_k (h, k), W_v (h, v), W_o (h, h), biases b_* (h,) or
    none.  Returns (output (B, Q, h), weights (B, H, Q, K))."""
    q, k, v = (
        ops.split_heads(linear(ops, x, weights["W_" + n], weights.get("b_" + n)), num_heads)
        for x, n in ((queries, "q"), (keys, "k"), (values, "v"))
    )
    heads, attention = dot_product_attention(ops, q, k, v, valid_lens, dropout, attention_mask, causal)
    return linear(ops, ops.merge_heads(heads), weights["W_o"], weights.get("b_o")), attention
