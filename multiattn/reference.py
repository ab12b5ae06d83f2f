"""A float64 numpy reference with analytic gradients, for ``multiattn check``.

Written from the formulas of d2l 11.3 and 11.5 and their derivatives, independently
of ``multiattn.core`` (it shares no code with the backends it judges).  Every
function returns a dict: ``out``, ``weights`` and, given a cotangent G,
``grads`` of sum(out * G) with respect to each input.

Masks: key j is visible to query i iff j < valid_len, the attention_mask entry is
nonzero and (when causal) j <= i; rows with nothing visible have weights exactly 0.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

Array = np.ndarray

_MHA_WEIGHTS = ("W_q", "W_k", "W_v", "W_o")
_MHA_BIASES = ("b_q", "b_k", "b_v", "b_o")


def length_mask(shape: tuple, valid_lens: Optional[Array]) -> Array:
    """True where key j of a (B, Q, K) or (B, H, Q, K) score tensor is below its valid length.

    valid_lens is (B,) or (B, Q): lengths index the batch and the queries, shared by heads.
    """
    if valid_lens is None:
        return np.ones(shape, dtype=bool)
    lens = np.asarray(valid_lens, dtype=np.float64)
    middle = (1,) * (len(shape) - 3)  # the head axis of a 4-D shape
    if lens.ndim == 1:
        lens = lens.reshape((lens.shape[0],) + middle + (1, 1))
    elif lens.ndim == 2:
        lens = lens.reshape((lens.shape[0],) + middle + (lens.shape[1], 1))
    else:
        raise ValueError(f"valid_lens must be (B,) or (B, Q), got shape {lens.shape}")
    # NaN compares False: a NaN length shows nothing
    return np.broadcast_to(np.arange(shape[-1]) < lens, shape)


def visibility(
    shape: tuple,
    valid_lens: Optional[Array] = None,
    attention_mask: Optional[Array] = None,
    causal: bool = False,
) -> Array:
    """Bool array of ``shape`` ((B, Q, K) or (B, H, Q, K)): True where key j is visible to query i."""
    shape = tuple(shape)
    visible = length_mask(shape, valid_lens).copy()
    if attention_mask is not None:
        allowed = np.asarray(attention_mask) != 0
        if allowed.ndim == 3 and len(shape) == 4:
            allowed = allowed[:, None]  # a (B, Q, K) mask is shared by the heads
        visible &= np.broadcast_to(allowed, shape)
    if causal:
        visible &= np.arange(shape[-1])[None, :] <= np.arange(shape[-2])[:, None]
    return visible


def _has_masks(valid_lens, attention_mask, causal) -> bool:
    return valid_lens is not None or attention_mask is not None or bool(causal)


def masked_softmax(
    X: Array,
    valid_lens: Optional[Array] = None,
    attention_mask: Optional[Array] = None,
    causal: bool = False,
) -> Array:
    X = np.asarray(X, dtype=np.float64)
    if _has_masks(valid_lens, attention_mask, causal):
        mask = visibility(X.shape, valid_lens, attention_mask, causal)
    else:
        mask = np.ones(X.shape, bool)
    peak = np.max(np.where(mask, X, -np.inf), axis=-1, keepdims=True, initial=-np.inf)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.where(mask, np.exp(np.where(mask, X, 0.0) - peak), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def _capped(scores: Array, softcap: Optional[float]) -> tuple:
    """(c tanh(s / c), its derivative 1 - tanh(s / c)^2): Gemma's soft-capping, before any
    mask; (scores, 1) without a cap."""
    if softcap is None:
        return scores, 1.0
    t = np.tanh(scores / softcap)
    return softcap * t, 1.0 - t**2


def _softmax_backward(weights: Array, d_weights: Array) -> Array:
    return weights * (d_weights - (d_weights * weights).sum(axis=-1, keepdims=True))


def masked_softmax_case(
    X: Array,
    valid_lens: Optional[Array] = None,
    cotangent: Optional[Array] = None,
    attention_mask: Optional[Array] = None,
    causal: bool = False,
    softcap: Optional[float] = None,
) -> dict:
    X, slope = _capped(np.asarray(X, dtype=np.float64), softcap)
    weights = masked_softmax(X, valid_lens, attention_mask, causal)
    result: dict = {"out": weights, "weights": weights}
    if cotangent is not None:
        result["grads"] = {"X": _softmax_backward(weights, np.asarray(cotangent, np.float64)) * slope}
    return result


def dot_product_attention(
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Optional[Array] = None,
    cotangent: Optional[Array] = None,
    attention_mask: Optional[Array] = None,
    causal: bool = False,
    softcap: Optional[float] = None,
) -> dict:
    """3-D (B, n, d), or 4-D (B, H, n, d) with keys and values of H_kv heads, query head i
    using key/value head i // (H / H_kv)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (queries, keys, values))
    group = q.shape[1] // k.shape[1] if q.ndim == 4 else 1
    # each key/value head repeated for the query heads of its group (here, where speed is no concern)
    k, v = (np.repeat(a, group, axis=1) for a in (k, v)) if group > 1 else (k, v)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores, slope = _capped(q @ np.swapaxes(k, -1, -2) * scale, softcap)
    weights = masked_softmax(scores, valid_lens, attention_mask, causal)
    result: dict = {"out": weights @ v, "weights": weights}
    if cotangent is not None:
        g = np.asarray(cotangent, dtype=np.float64)
        d_scores = _softmax_backward(weights, g @ np.swapaxes(v, -1, -2)) * slope
        d_k, d_v = np.swapaxes(d_scores, -1, -2) @ q * scale, np.swapaxes(weights, -1, -2) @ g
        result["grads"] = {
            "queries": d_scores @ k * scale,
            "keys": _group_sums(d_k, group) if group > 1 else d_k,
            "values": _group_sums(d_v, group) if group > 1 else d_v,
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
    attention_mask: Optional[Array] = None,
    causal: bool = False,
    softcap: Optional[float] = None,
) -> dict:
    q, k, v, W_q, W_k, w_v = (np.asarray(a, dtype=np.float64) for a in (queries, keys, values, W_q, W_k, w_v))
    hidden_q, hidden_k = q @ W_q.T, k @ W_k.T  # (B, Q, h), (B, K, h)
    features = np.tanh(hidden_q[:, :, None, :] + hidden_k[:, None, :, :])  # (B, Q, K, h)
    scores, slope = _capped(features @ w_v, softcap)
    weights = masked_softmax(scores, valid_lens, attention_mask, causal)
    result: dict = {"out": weights @ v, "weights": weights}
    if cotangent is not None:
        g = np.asarray(cotangent, dtype=np.float64)
        d_scores = _softmax_backward(weights, g @ np.swapaxes(v, 1, 2)) * slope  # (B, Q, K)
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


def _split_heads(X: Array, num_heads: int) -> Array:
    """(B, n, h) -> (B, H, n, h/H): head i takes columns i*d .. (i+1)*d-1."""
    B, n, h = X.shape
    return X.reshape(B, n, num_heads, h // num_heads).transpose(0, 2, 1, 3)


def _merge_heads(X: Array) -> Array:
    """(B, H, n, d) -> (B, n, H*d), the inverse of _split_heads."""
    B, H, n, d = X.shape
    return X.transpose(0, 2, 1, 3).reshape(B, n, H * d)


def _group_sums(x: Array, group: int) -> Array:
    """(B, H, n, d) -> (B, H / group, n, d): the sum over each run of `group` heads."""
    B, H, n, d = x.shape
    return x.reshape(B, H // group, group, n, d).sum(axis=2)


def multi_head_attention(
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Optional[Array],
    weights: dict,
    num_heads: int,
    cotangent: Optional[Array] = None,
    attention_mask: Optional[Array] = None,
    causal: bool = False,
    num_kv_heads: Optional[int] = None,
    softcap: Optional[float] = None,
) -> dict:
    """d2l 11.5: project to h, split into heads, scaled dot-product per head, concat, W_o.

    weights: W_q (h, q), W_k (h, k), W_v (h, v), W_o (h, h), optionally all of b_q, b_k, b_v, b_o (h,).
    num_kv_heads: grouped-query attention, W_k, W_v, b_k, b_v of num_kv_heads * h / num_heads
    rows, query head i using key/value head i // (num_heads / num_kv_heads).
    """
    missing = [name for name in _MHA_WEIGHTS if name not in weights]
    biases = [name for name in _MHA_BIASES if name in weights]
    if missing:
        raise ValueError(f"multi_head_attention needs weights {missing}")
    if biases and len(biases) != len(_MHA_BIASES):
        raise ValueError(f"multi_head_attention takes all of {_MHA_BIASES} or none, got {biases}")
    p = {name: np.asarray(weights[name], dtype=np.float64) for name in _MHA_WEIGHTS + tuple(biases)}
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (queries, keys, values))
    h = p["W_q"].shape[0]
    if h % num_heads:
        raise ValueError(f"num_hiddens {h} is not divisible by num_heads {num_heads}")
    scale = 1.0 / math.sqrt(h // num_heads)
    kv_heads = num_kv_heads or num_heads
    group = num_heads // kv_heads
    zero, kv_zero = np.zeros(h), np.zeros(p["W_k"].shape[0])
    q_p = q @ p["W_q"].T + p.get("b_q", zero)
    k_p = k @ p["W_k"].T + p.get("b_k", kv_zero)
    v_p = v @ p["W_v"].T + p.get("b_v", kv_zero)
    q_h = _split_heads(q_p, num_heads)  # (B, H, n, d)
    # each key/value head repeated for the query heads of its group (here, where speed is no concern)
    k_h, v_h = (np.repeat(_split_heads(a, kv_heads), group, axis=1) for a in (k_p, v_p))
    scores, slope = _capped(q_h @ np.swapaxes(k_h, -1, -2) * scale, softcap)  # (B, H, Q, K)
    attn = masked_softmax(scores, valid_lens, attention_mask, causal)
    concat = _merge_heads(attn @ v_h)  # (B, Q, h)
    result: dict = {"out": concat @ p["W_o"].T + p.get("b_o", zero), "weights": attn}
    if cotangent is not None:
        g = np.asarray(cotangent, dtype=np.float64)
        d_heads = _split_heads(g @ p["W_o"], num_heads)  # d concat, per head
        d_scores = _softmax_backward(attn, d_heads @ np.swapaxes(v_h, -1, -2)) * slope
        d_q_p = _merge_heads(d_scores @ k_h * scale)
        d_k_p, d_v_p = (
            _merge_heads(_group_sums(d, group))  # a shared head's gradient: its group's sum
            for d in (np.swapaxes(d_scores, -1, -2) @ q_h * scale, np.swapaxes(attn, -1, -2) @ d_heads)
        )
        grads = {
            "queries": d_q_p @ p["W_q"],
            "keys": d_k_p @ p["W_k"],
            "values": d_v_p @ p["W_v"],
            "W_q": np.einsum("bni,bnj->ij", d_q_p, q),
            "W_k": np.einsum("bni,bnj->ij", d_k_p, k),
            "W_v": np.einsum("bni,bnj->ij", d_v_p, v),
            "W_o": np.einsum("bni,bnj->ij", g, concat),
        }
        if biases:
            grads.update(
                b_q=d_q_p.sum(axis=(0, 1)),
                b_k=d_k_p.sum(axis=(0, 1)),
                b_v=d_v_p.sum(axis=(0, 1)),
                b_o=g.sum(axis=(0, 1)),
            )
        result["grads"] = grads
    return result
