"""Independent float64 reference, written from the formulas of d2l 11.3 and 11.5 with loops.

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


def _mask_entry(mask: np.ndarray, index: tuple, shape: tuple) -> bool:
    """mask[index] under numpy broadcasting to ``shape``: right-aligned, a size-1 axis repeats."""
    if mask.ndim > len(shape):
        raise ValueError(f"a mask of rank {mask.ndim} cannot index scores of rank {len(shape)}")
    offset = len(shape) - mask.ndim
    position = []
    for axis, size in enumerate(mask.shape):
        if size not in (1, shape[offset + axis]):
            raise ValueError(f"mask of shape {mask.shape} does not broadcast to {shape}")
        position.append(0 if size == 1 else index[offset + axis])
    return bool(mask[tuple(position)] != 0)


def visible(shape, valid_lens=None, attention_mask=None, causal=False) -> np.ndarray:
    """visible[b, (h,) i, j]: key j may be seen by query i (all of length, mask, causal)."""
    shape = tuple(shape)
    lens = None if valid_lens is None else np.asarray(valid_lens, dtype=np.float64)
    mask = None if attention_mask is None else np.asarray(attention_mask)
    out = np.zeros(shape, dtype=bool)
    for index in np.ndindex(shape):
        b, i, j = index[0], index[-2], index[-1]
        ok = True
        if lens is not None:
            length = lens[b] if lens.ndim == 1 else lens[b, i]
            ok = ok and j < length  # NaN: False
        if mask is not None:
            # a (B, Q, K) mask against (B, H, Q, K) scores is shared by the heads
            if mask.ndim == 3 and len(shape) == 4:
                allowed = _mask_entry(mask, (b, i, j), (shape[0], shape[2], shape[3]))
            else:
                allowed = _mask_entry(mask, index, shape)
            ok = ok and allowed
        if causal:
            ok = ok and j <= i
        out[index] = ok
    return out


def masked_softmax(X, valid_lens=None, attention_mask=None, causal=False) -> np.ndarray:
    X = np.asarray(X, dtype=np.float64)
    out = np.zeros_like(X)
    if valid_lens is None and attention_mask is None and not causal:
        for row in np.ndindex(X.shape[:-1]):
            out[row] = softmax_row(X[row])
        return out
    if X.ndim not in (3, 4):
        raise ValueError(f"masked scores are (B, Q, K) or (B, H, Q, K), got shape {X.shape}")
    seen = visible(X.shape, valid_lens, attention_mask, causal)
    for row in np.ndindex(X.shape[:-1]):
        columns = [j for j in range(X.shape[-1]) if seen[row + (j,)]]
        if columns:  # a row with nothing visible stays 0
            weights = softmax_row(X[row][columns])
            for j, w in zip(columns, weights):
                out[row + (j,)] = w
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


def dot_product_attention(queries, keys, values, valid_lens=None, attention_mask=None, causal=False):
    """(output, weights) of softmax(Q K^T / sqrt(d)) V."""
    weights = masked_softmax(dot_product_scores(queries, keys), valid_lens, attention_mask, causal)
    return pool(weights, values), weights


def additive_attention(queries, keys, values, valid_lens, W_q, W_k, w_v, attention_mask=None, causal=False):
    scores = additive_scores(queries, keys, W_q, W_k, w_v)
    weights = masked_softmax(scores, valid_lens, attention_mask, causal)
    return pool(weights, values), weights


def project(X, W, b=None) -> np.ndarray:
    """X[b, n] -> W X[b, n] + b for every batch element and position."""
    X = np.asarray(X, dtype=np.float64)
    W = np.asarray(W, dtype=np.float64)
    B, n, _ = X.shape
    out = np.zeros((B, n, W.shape[0]))
    for batch in range(B):
        for t in range(n):
            out[batch, t] = W @ X[batch, t]
            if b is not None:
                out[batch, t] += np.asarray(b, dtype=np.float64)
    return out


def multi_head_attention(
    queries, keys, values, valid_lens, weights, num_heads, attention_mask=None, causal=False,
    num_kv_heads=None, mask_fn=None, score_fn=None,
):  # fmt: skip
    """(output (B, Q, h), weights (B, H, Q, K)) of d2l 11.5: head i uses columns i*d .. (i+1)*d-1
    of the projected queries and, of the projected keys and values, those of key/value head
    i // (num_heads / num_kv_heads) (grouped-query attention; default: head i's own).
    mask_fn(b, h, i, j): a mask function's formula, ANDed with the masks; score_fn(s, b, h, i,
    j): a score function's, on the scaled scores."""
    q_p = project(queries, weights["W_q"], weights.get("b_q"))
    k_p = project(keys, weights["W_k"], weights.get("b_k"))
    v_p = project(values, weights["W_v"], weights.get("b_v"))
    B, Q, h = q_p.shape
    K = k_p.shape[1]
    d = h // num_heads
    assert d * num_heads == h, "num_hiddens must be divisible by num_heads"
    group = num_heads // (num_kv_heads or num_heads)
    scores = np.zeros((B, num_heads, Q, K))
    for b in range(B):
        for head in range(num_heads):
            kv = head // group
            for i in range(Q):
                for j in range(K):
                    scores[b, head, i, j] = sum(
                        q_p[b, i, head * d + c] * k_p[b, j, kv * d + c] for c in range(d)
                    ) / math.sqrt(d)
    if score_fn is not None:
        scores = modified_scores(scores, score_fn)
    if mask_fn is not None:
        shown = function_mask(scores.shape, mask_fn)
        attention_mask = shown if attention_mask is None else shown & np.asarray(attention_mask, dtype=bool)
    attn = masked_softmax(scores, valid_lens, attention_mask, causal)
    concat = np.zeros((B, Q, h))
    for b in range(B):
        for head in range(num_heads):
            kv = head // group
            for i in range(Q):
                for j in range(K):
                    for c in range(d):
                        concat[b, i, head * d + c] += attn[b, head, i, j] * v_p[b, j, kv * d + c]
    return project(concat, weights["W_o"], weights.get("b_o")), attn


# -- score and mask functions (issue: mods), by loops over every (b, h, i, j) ----------------


def function_mask(shape, fn) -> np.ndarray:
    """visible[b, (h,) i, j] = fn(b, h, i, j) for scores of shape (B, [H,] Q, K); h = 0 for
    3-D scores."""
    out = np.zeros(shape, dtype=bool)
    for index in np.ndindex(tuple(shape)):
        b, i, j = index[0], index[-2], index[-1]
        out[index] = bool(fn(b, index[1] if len(shape) == 4 else 0, i, j))
    return out


def modified_scores(scores, fn) -> np.ndarray:
    """scores[b, (h,) i, j] replaced by fn(score, b, h, i, j)."""
    scores = np.asarray(scores, dtype=np.float64)
    out = np.empty_like(scores)
    for index in np.ndindex(scores.shape):
        b, i, j = index[0], index[-2], index[-1]
        out[index] = fn(float(scores[index]), b, index[1] if scores.ndim == 4 else 0, i, j)
    return out


def heads_attention(
    queries, keys, values, valid_lens=None, attention_mask=None, causal=False, scale=None,
    mask_fn=None, score_fn=None,
):  # fmt: skip
    """(output (B, H, Q, v), weights (B, H, Q, K)) of 4-D attention: queries (B, H, Q, d), keys
    and values (B, H_kv, K, .), query head h using key/value head h // (H / H_kv); scores
    scale * q . k (default 1 / sqrt(d)), then score_fn(s, b, h, i, j); hidden where the lengths,
    the mask (broadcast to (B, H, Q, K); 3-D: (B, Q, K)), causality or mask_fn(b, h, i, j) say."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (queries, keys, values))
    B, H, Q, d = q.shape
    H_kv, K = k.shape[1], k.shape[2]
    group = H // H_kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = np.zeros((B, H, Q, K))
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                for j in range(K):
                    s = scale * sum(q[b, h, i, c] * k[b, h // group, j, c] for c in range(d))
                    scores[b, h, i, j] = s if score_fn is None else score_fn(s, b, h, i, j)
    if mask_fn is not None:
        shown = function_mask(scores.shape, mask_fn)
        if attention_mask is not None:
            mask = np.asarray(attention_mask, dtype=bool)
            mask = mask[:, None] if mask.ndim == 3 else mask
            shown = shown & np.broadcast_to(mask, shown.shape)
        attention_mask = shown
    weights = masked_softmax(scores, valid_lens, attention_mask, causal)
    out = np.zeros((B, H, Q, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                for j in range(K):
                    out[b, h, i] += weights[b, h, i, j] * v[b, h // group, j]
    return out, weights


def heads_lse(queries, keys, scale=None, mask_fn=None, score_fn=None) -> np.ndarray:
    """lse (B, H, Q) of 4-D attention: log of the sum over the keys that mask_fn(b, h, i, j)
    shows of exp(score_fn(scale * q . k, b, h, i, j)); -inf where it shows none."""
    q, k = (np.asarray(x, dtype=np.float64) for x in (queries, keys))
    B, H, Q, d = q.shape
    group = H // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.full((B, H, Q), -np.inf)
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                seen = []
                for j in range(k.shape[2]):
                    if mask_fn is None or mask_fn(b, h, i, j):
                        s = scale * sum(q[b, h, i, c] * k[b, h // group, j, c] for c in range(d))
                        seen.append(s if score_fn is None else score_fn(s, b, h, i, j))
                if seen:
                    top = max(seen)
                    out[b, h, i] = top + math.log(sum(math.exp(s - top) for s in seen))
    return out
