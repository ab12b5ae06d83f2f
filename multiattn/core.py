"""The math of d2l sections 11.3 and 11.5, once: the code every public call runs.

Each entry function is the book's algorithm as a short sequence of named steps over the
primitives of ``protocol.Primitives``.  Three steps may be done by an adapter's
specialisation instead (``specialise.run``); each replaces that step and nothing else.  A
call without weights past the scores budget runs in blocks (``schedule``).  The arguments
arrive checked (``validation``), the masks as one value (``masks.Masks``).  Shapes: queries
(B, [H,] Q, q), keys (B, [H,] K, k), values (B, [H,] K, v), scores and weights (B, [H,] Q, K).
The row rule: a score of -inf hides its key, so a row with nothing visible gets weights 0.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

from . import blockwise, heads, mods, schedule, specialise, state
from .masks import NO_MASKS, Masks, visibility, visible_values

Tensor = Any
Ops = Any  # an adapter (``adapter.Ops``): the primitives and the specialisations
Dropout = Optional[Callable[[Tensor], Tensor]]
ScoreMod = Optional[Callable[..., Tensor]]  # score_mod(score, b, h, q_idx, kv_idx), as in ``mods``


def masked_softmax(ops: Ops, X: Tensor, masks: Masks = NO_MASKS, score_mod: ScoreMod = None) -> Tensor:
    """w_ij = exp(x_ij) / sum_{l visible} exp(x_il) for j visible (``visibility``), else 0;
    score_mod (``mods``) first, on X.  X is the caller's, never written."""
    if 0 in ops.shape(X):
        return ops.zeros(ops.shape(X), X)
    if score_mod is not None:
        X = modified_scores(ops, score_mod, X)
    masks, asks = masks.with_mask_mod_evaluated(ops, X), specialise.asks(ops, ops.shape(X))
    return masked_weights(ops, X, None, masks, owned=False, asks=asks)[0]


def dot_product_attention(
    ops: Ops, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks = NO_MASKS, *,
    scale: Optional[float] = None, dropout: Dropout = None, need_weights: bool = True,
    block_size: Optional[int] = None, need_lse: bool = False, score_mod: ScoreMod = None,
) -> tuple:  # fmt: skip
    """softmax(Q K^T * scale) V, masked, scale 1 / sqrt(d) by default, score_mod on the scaled
    scores: (output, weights or None where need_weights is False[, lse (B, [H,] Q), the log
    of the sum of exp of each row's visible scores, -inf where none is, with need_lse])."""
    q_shape, k_shape = ops.shape(queries), ops.shape(keys)
    if 0 in q_shape[:-1] or k_shape[-2] == 0:
        out, weights = no_attention(ops, queries, keys, values)
        return (out, weights, blockwise.no_lse(ops, out)) if need_lse else (out, weights)
    scale = 1.0 / math.sqrt(q_shape[-1]) if scale is None else scale
    if not need_weights and dropout is None:
        done = schedule.dot_product_in_blocks(
            ops, queries, keys, values, masks, scale, block_size, need_lse, score_mod
        )
        if done is not None:
            return (done[0], None, done[1]) if need_lse else (done[0], None)
    if masks.mask_mod is not None:
        masks = masks.with_mask_mod_evaluated(ops, queries, tuple(q_shape[:-1]) + (k_shape[-2],))
    asks = specialise.asks(ops, (*q_shape[:-1], k_shape[-2]))
    if asks and not (need_lse or score_mod is not None):
        args = (queries, keys, values, masks, scale, dropout, need_weights)
        done = specialise.run(ops, "dot_product_attend", *args)
        if done is not None:
            return done
    scores = dot_product_scores(ops, queries, keys, scale)
    if score_mod is not None:
        scores = modified_scores(ops, score_mod, scores)
    lse = state.log_sum_exp(ops, ops.widen(scores), visibility(ops, masks, scores)) if need_lse else None
    out, weights = attend(ops, scores, values, masks, dropout, asks)
    weights = weights if need_weights else None
    return (out, weights, lse[..., 0]) if need_lse else (out, weights)


def additive_attention(
    ops: Ops, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks = NO_MASKS, *,
    project_q: Callable[[Tensor], Tensor], project_k: Callable[[Tensor], Tensor], w_v: Tensor,
    dropout: Dropout = None, need_weights: bool = True, block_size: Optional[int] = None,
    score_mod: ScoreMod = None,
) -> tuple[Tensor, Optional[Tensor]]:  # fmt: skip
    """a(q, k) = w_v^T tanh(W_q q + W_k k), no biases: (output, weights or None).  project_q,
    project_k: q -> W_q q and k -> W_k k; score_mod (``mods``) on the scores."""
    if nothing_to_attend(ops, queries, keys):
        return no_attention(ops, queries, keys, values)
    q_hidden, k_hidden = project_q(queries), project_k(keys)
    batch = ops.shape(queries)[0]

    def scores_of(q, k, block=None):
        found = additive_scores(ops, q, k, ops.widen(w_v) if block else w_v, NO_MASKS if block else masks)
        if score_mod is None:
            return found
        block = block or (0, ops.shape(q)[-2], 0, ops.shape(k)[-2])
        return mods.apply_score_mod(ops, score_mod, found, block, batch)

    if not need_weights and dropout is None:
        out = schedule.additive_in_blocks(ops, q_hidden, k_hidden, values, masks, scores_of, block_size)
        if out is not None:
            return out, None
    masks = masks.with_mask_mod_evaluated(ops, queries, _scores_shape(ops, queries, keys))
    out, weights = attend(ops, scores_of(q_hidden, k_hidden), values, masks, dropout)
    return out, (weights if need_weights else None)


def multi_head_attention(
    ops: Ops, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks = NO_MASKS, *,
    project: Mapping[str, Callable[[Tensor], Tensor]], num_heads: int, num_hiddens: int,
    dropout: Dropout = None, need_weights: bool = True, block_size: Optional[int] = None,
    score_mod: ScoreMod = None, num_kv_heads: Optional[int] = None, scale: Optional[float] = None,
) -> tuple[Tensor, Optional[Tensor]]:  # fmt: skip
    """d2l 11.5: h_i = f(W_q^(i) q, W_k^(i) k, W_v^(i) v), scaled dot-product attention on the
    i-th group of num_hiddens / num_heads columns; out = W_o [h_1, ..., h_H].  project: "q",
    "k", "v", "o" -> x -> W x (+ b).  num_kv_heads: W_k and W_v give that many heads, query
    head i using key/value head i // (num_heads / num_kv_heads) (``heads``), never repeated.
    Returns (output (B, Q, num_hiddens), weights (B, H, Q, K) or None)."""
    (batch, n_queries), n_keys = ops.shape(queries)[:2], ops.shape(keys)[1]
    if 0 in (batch, n_queries, n_keys):  # no keys: every row fully masked, the heads give 0
        pooled = ops.zeros((batch, n_queries, num_hiddens), queries)
        weights = ops.zeros((batch, num_heads, n_queries, n_keys), queries)
        return (project["o"](pooled) if batch and n_queries else pooled), weights
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    q = ops.split_heads(project["q"](queries), num_heads)
    k, v = (ops.split_heads(project[n](x), kv_heads) for n, x in zip("kv", (keys, values)))
    scale = 1.0 / math.sqrt(num_hiddens // num_heads) if scale is None else scale
    pooled, weights = dot_product_attention(
        ops, q, k, v, masks, scale=scale, dropout=dropout, need_weights=need_weights,
        block_size=block_size, score_mod=score_mod,
    )  # fmt: skip
    return project["o"](ops.merge_heads(pooled)), weights


# -- steps ---------------------------------------------------------------------------------


def dot_product_scores(ops: Ops, queries: Tensor, keys: Tensor, scale: float) -> Tensor:
    """a(q, k) = q^T k * scale: (B, [H,] Q, K); keys may have fewer heads (``heads``)."""
    return state.scores(ops, queries, keys, scale)


def additive_scores(ops: Ops, q_hidden: Tensor, k_hidden: Tensor, w_v: Tensor, masks: Masks = NO_MASKS):
    """a(q, k) = w_v^T tanh(W_q q + W_k k) from W_q q (B, Q, h) and W_k k (B, K, h): the
    features (B, Q, K, h) summed by broadcasting, as d2l does (hidden keys' scores: anything)."""
    done = specialise.run(ops, "additive_scores", q_hidden, k_hidden, w_v, masks)
    if done is not None:
        return done
    return ops.matmul(ops.tanh(ops.expand_dims(q_hidden, 2) + ops.expand_dims(k_hidden, 1)), w_v)


def modified_scores(ops: Ops, score_mod: Callable[..., Tensor], scores: Tensor) -> Tensor:
    """score_mod on the whole scores (B, [H,] Q, K)."""
    shape = ops.shape(scores)
    return mods.apply_score_mod(ops, score_mod, scores, (0, shape[-2], 0, shape[-1]), shape[0])


def attend(ops: Ops, scores: Tensor, values: Tensor, masks: Masks, dropout: Dropout = None, asks=True):
    """(attention pooling of values by the masked softmax of the core's own scores, the
    weights before dropout); asks: whether to ask the specialisations (``specialise.asks``)."""
    weights, values = masked_weights(ops, scores, values, masks, owned=True, asks=asks)
    return attention_pooling(ops, weights, values, dropout), weights


def masked_weights(ops: Ops, scores: Tensor, values: Optional[Tensor], masks: Masks, owned: bool, asks=True):
    """(the masked softmax of scores, values with the rows no query may see set to 0).
    owned: the scores are the core's own, and may be written (a specialisation's passes)."""
    done = specialise.run(ops, "masked_softmax", scores, values, masks, owned) if asks else None
    if done is not None:
        return done
    return softmax_where(ops, scores, values, masks, where=ops.where, safe_softmax=ops.safe_softmax)


def softmax_where(ops: Ops, X: Tensor, values: Optional[Tensor], masks: Masks, *, where, safe_softmax):
    """``masked_weights`` by its formula, with the ``where`` and ``safe_softmax`` given (the
    primitives, or an adapter's passes that write into scores the core owns).  The row rule: a
    hidden key's score becomes -inf, whose weight is 0, so a row with nothing visible gets 0."""
    mask = visibility(ops, masks, X)
    weights = safe_softmax(X if mask is None else where(mask, X, -math.inf))
    return weights, values if values is None or mask is None else visible_values(ops, values, mask)


def attention_pooling(ops: Ops, weights: Tensor, values: Tensor, dropout: Dropout = None) -> Tensor:
    """f(q, (k_1, v_1), ..., (k_m, v_m)) = sum_i alpha(q, k_i) v_i, dropout on the weights."""
    return heads.matmul(ops, weights if dropout is None else dropout(weights), values)


def linear(ops: Ops, x: Tensor, W: Tensor, b: Tensor = None) -> Tensor:
    """W x + b for every row of x: x (..., in), W (out, in), b (out,) or None."""
    y = ops.matmul_t(x, W)
    return y if b is None else y + b


def _scores_shape(ops: Ops, queries: Tensor, keys: Tensor) -> tuple:
    return tuple(ops.shape(queries)[:-1]) + (ops.shape(keys)[-2],)


def nothing_to_attend(ops: Ops, queries: Tensor, keys: Tensor) -> bool:
    """Some dimension of the scores (B, [H,] Q, K) is 0 (no kernel runs: some abort)."""
    return 0 in ops.shape(queries)[:-1] or ops.shape(keys)[-2] == 0


def no_attention(ops: Ops, queries: Tensor, keys: Tensor, values: Tensor) -> tuple:
    """The answer where some dimension is 0: no keys means every row fully masked, so 0."""
    rows, n_keys, width = ops.shape(queries)[:-1], ops.shape(keys)[-2], ops.shape(values)[-1]
    return ops.zeros(tuple(rows) + (width,), values), ops.zeros(tuple(rows) + (n_keys,), values)
