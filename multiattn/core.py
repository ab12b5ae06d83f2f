"""The math of d2l sections 11.3 and 11.5, once: the code every public call runs.

Each entry function (``masked_softmax``, ``dot_product_attention``, ``additive_attention``,
``multi_head_attention``) is the book's algorithm as a short sequence of named steps over
the required primitives of ``protocol.Ops``.  Three steps may be done by an adapter's
specialisation instead (``specialise.run``: ``dot_product_attend``, ``masked_softmax``,
``additive_scores``); each replaces that step and nothing else, and the core's formula runs
where they decline.  The arguments arrive checked (``validation``), the masks as one value
(``masks.Masks``).  Shapes: queries (B, [H,] Q, q), keys (B, [H,] K, k), values (B, [H,] K, v),
scores and weights (B, [H,] Q, K), valid_lens (B,) or (B, Q), attention_mask boolean
(True: may attend), broadcastable to the scores.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, Optional

from . import block_loop, blockwise, heads, mods, specialise
from .masks import NO_MASKS, Masks, all_of, visibility, visible_values  # noqa: F401 (the steps')

Tensor = Any
Ops = Any  # protocol.Ops (not imported: protocol's specialisations build on this module)
Dropout = Optional[Callable[[Tensor], Tensor]]
ScoreMod = Optional[Callable[..., Tensor]]  # score_mod(score, b, h, q_idx, kv_idx), as in ``mods``


# -- entry functions -----------------------------------------------------------------------


def masked_softmax(ops: Ops, X: Tensor, masks: Masks = NO_MASKS, score_mod: ScoreMod = None) -> Tensor:
    """softmax over the last axis with the hidden positions weighted exactly 0:
    w_ij = exp(x_ij) / sum_{l visible} exp(x_il) for j visible (``visibility``), else 0;
    score_mod (``mods``) first, on X.  X is the caller's, never written."""
    if 0 in ops.shape(X):
        return ops.zeros(ops.shape(X), X)
    if score_mod is not None:
        X = modified_scores(ops, score_mod, X)
    masks = masks.with_mask_mod_evaluated(ops, X)
    weights = masked_weights(ops, X, None, masks, owned=False)[0]
    if not holds_non_finite(ops, weights):
        return weights
    return masked_weights(ops, X, None, masks, owned=False, rows_may_be_blank=True)[0]  # the row rule


def dot_product_attention(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    masks: Masks = NO_MASKS,
    *,
    scale: Optional[float] = None,
    dropout: Dropout = None,
    need_weights: bool = True,
    block_size: Optional[int] = None,
    need_lse: bool = False,
    score_mod: ScoreMod = None,
) -> tuple:
    """softmax(Q K^T / sqrt(d)) V, masked: (output (B, [H,] Q, v), weights (B, [H,] Q, K), or
    None for the weights where need_weights is False), and with need_lse a third, lse (B, [H,]
    Q), the log of the sum of exp of each row's visible scores (-inf where none is).
    scale: 1 / sqrt(d) by default; score_mod (``mods``) on the scaled scores.  Without weights
    or dropout the scores are computed in blocks (``blockwise``) of block_size, or where they
    would exceed the budget (None)."""
    q_shape = ops.shape(queries)
    if 0 in q_shape[:-1] or ops.shape(keys)[-2] == 0:  # nothing to attend: no kernel runs
        out, weights = no_attention(ops, queries, keys, values)
        return (out, weights, blockwise.no_lse(ops, out)) if need_lse else (out, weights)
    if scale is None:
        scale = 1.0 / math.sqrt(q_shape[-1])
    if not need_weights and dropout is None:
        forced = block_size is not None
        block_size = block_size or blockwise.automatic_block_size(
            ops, queries, keys, mask_mod=masks.mask_mod, masks=masks
        )
        if block_size is not None:
            masks = masks.without_idle_lengths(ops, ops.shape(keys)[-2])
            if score_mod is None and not (forced or need_lse):  # a framework's kernel that never holds
                # the scores whole (grouped heads and a mask function's too, where its offer takes them)
                done = specialise.run(ops, "attend_past_memory", queries, keys, values, masks, scale)
                if done is not None and not holds_non_finite(ops, done[0]):
                    return done
            if score_mod is None:  # a compiler's one loop where traced, else the host's plan
                loop = block_loop if block_loop.usable(ops, queries, masks) else blockwise
                block_size = block_size if forced or loop is blockwise else min(block_size, loop.MAX_BLOCK)
                out, lse = loop.attention(
                    ops, queries, keys, values, masks, scale=scale, block_size=block_size
                )
            else:  # the framework differentiates the blocks (and score_mod) itself
                out, lse = blockwise.attention_in_blocks(
                    ops, queries, keys, values, masks, block_size=block_size,
                    score=functools.partial(_modified_dot_product_scores, ops, score_mod, scale),
                )  # fmt: skip
                lse = lse[..., 0]
            return (out, None, lse) if need_lse else (out, None)
    args = (ops, queries, keys, values, masks, scale, dropout, need_weights, need_lse, score_mod)
    result = _materialised(*args)
    if not holds_non_finite(ops, result[0]):
        return result
    # some output is NaN or inf: were some row's scores all -inf, the frameworks' kernels
    # would differ on it, so the formula, with the row rule, says what it is
    return _materialised(*args, rows_may_be_blank=True)


def _materialised(
    ops,
    queries,
    keys,
    values,
    masks,
    scale,
    dropout,
    need_weights,
    need_lse,
    score_mod,
    rows_may_be_blank=False,
):
    """``dot_product_attention`` with the scores whole (or a framework's fused kernel)."""
    masks = masks.with_mask_mod_evaluated(ops, queries, _scores_shape(ops, queries, keys))
    if not (need_lse or rows_may_be_blank or score_mod is not None or grouped(ops, queries, keys)):
        done = specialise.run(
            ops, "dot_product_attend", queries, keys, values, masks, scale, dropout, need_weights
        )
        if done is not None:
            return done
    scores = dot_product_scores(ops, queries, keys, scale)
    if score_mod is not None:
        scores = modified_scores(ops, score_mod, scores)
    lse = blockwise.log_sum_exp(ops, scores, visibility(ops, masks, scores)) if need_lse else None
    out, weights = attend(
        ops, scores, values, masks, dropout, exact=need_weights, rows_may_be_blank=rows_may_be_blank
    )
    weights = weights if need_weights else None
    return (out, weights, lse) if need_lse else (out, weights)


def additive_attention(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    masks: Masks = NO_MASKS,
    *,
    project_q: Callable[[Tensor], Tensor],
    project_k: Callable[[Tensor], Tensor],
    w_v: Tensor,
    dropout: Dropout = None,
    need_weights: bool = True,
    block_size: Optional[int] = None,
    score_mod: ScoreMod = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """a(q, k) = w_v^T tanh(W_q q + W_k k), no biases: (output, weights, or None where
    need_weights is False).  project_q and project_k: q -> W_q q and k -> W_k k (the canonical
    weights', or a layer's own maps); score_mod (``mods``) on the scores.  Without weights or
    dropout the features and scores are made in blocks (``blockwise``) of block_size, or where
    the scores would exceed the budget."""
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
        per_score = ops.shape(q_hidden)[-1] or 1  # the features of a block are its scores x hiddens
        block_size = block_size or blockwise.automatic_block_size(
            ops, queries, keys, per_score, mask_mod=masks.mask_mod
        )
        if block_size is not None:  # the framework differentiates the blocks itself
            out, _ = blockwise.attention_in_blocks(
                ops, q_hidden, k_hidden, values, masks, block_size=block_size, score=scores_of
            )
            return out, None
    masks = masks.with_mask_mod_evaluated(ops, queries, _scores_shape(ops, queries, keys))
    scores = scores_of(q_hidden, k_hidden)
    out, weights = attend(ops, scores, values, masks, dropout)
    if holds_non_finite(ops, out):  # the row rule, as in dot_product_attention
        out, weights = attend(ops, scores, values, masks, dropout, rows_may_be_blank=True)
    return out, (weights if need_weights else None)


def multi_head_attention(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    masks: Masks = NO_MASKS,
    *,
    project: Mapping[str, Callable[[Tensor], Tensor]],
    num_heads: int,
    num_hiddens: int,
    dropout: Dropout = None,
    need_weights: bool = True,
    block_size: Optional[int] = None,
    score_mod: ScoreMod = None,
    num_kv_heads: Optional[int] = None,
    scale: Optional[float] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """d2l 11.5: h_i = f(W_q^(i) q, W_k^(i) k, W_v^(i) v) per head i, scaled dot-product
    attention on the i-th group of num_hiddens / num_heads columns; out = W_o [h_1, ..., h_H].
    project: "q", "k", "v", "o" -> x -> W x (+ b).  Returns (output (B, Q, num_hiddens),
    weights (B, H, Q, K) or None where need_weights is False).  block_size: as in
    ``dot_product_attention``.  num_kv_heads (default num_heads): grouped-query attention,
    W_k and W_v give num_kv_heads heads of the same width, query head i using key/value head
    i // (num_heads / num_kv_heads) (``heads``), the keys and values never repeated.  scale:
    of each head's scores (default 1 / sqrt(num_hiddens / num_heads))."""
    (batch, n_queries), n_keys = ops.shape(queries)[:2], ops.shape(keys)[1]
    if 0 in (batch, n_queries):
        return (
            ops.zeros((batch, n_queries, num_hiddens), queries),
            ops.zeros((batch, num_heads, n_queries, n_keys), queries),
        )
    if n_keys == 0:  # every row fully masked: the heads give 0
        pooled = ops.zeros((batch, n_queries, num_hiddens), queries)
        return project["o"](pooled), ops.zeros((batch, num_heads, n_queries, 0), queries)
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    q = ops.split_heads(project["q"](queries), num_heads)
    k, v = (ops.split_heads(project[n](x), kv_heads) for n, x in zip("kv", (keys, values)))
    scale = 1.0 / math.sqrt(num_hiddens // num_heads) if scale is None else scale
    pooled, weights = dot_product_attention(
        ops, q, k, v, masks, scale=scale, dropout=dropout, need_weights=need_weights, block_size=block_size,
        score_mod=score_mod,
    )  # fmt: skip
    return project["o"](ops.merge_heads(pooled)), weights


# -- steps ---------------------------------------------------------------------------------


def grouped(ops: Ops, queries: Tensor, keys: Tensor) -> bool:
    """Whether query heads share key/value heads (``heads``): the specialisations of the
    materialised sizes are not asked (most take one key head per query head); past the
    budget an adapter's offer may take them (torch: SDPA's ``enable_gqa``)."""
    return heads.groups(ops, queries, keys) > 1


def _scores_shape(ops: Ops, queries: Tensor, keys: Tensor) -> tuple:
    return tuple(ops.shape(queries)[:-1]) + (ops.shape(keys)[-2],)


def modified_scores(ops: Ops, score_mod: Callable[..., Tensor], scores: Tensor) -> Tensor:
    """score_mod on the whole scores (B, [H,] Q, K)."""
    shape = ops.shape(scores)
    return mods.apply_score_mod(ops, score_mod, scores, (0, shape[-2], 0, shape[-1]), shape[0])


def _modified_dot_product_scores(ops, score_mod, scale, q, k, block):
    """A block's scaled dot-product scores, then score_mod on them."""
    scores = heads.scaled_matmul_t(ops, q, k, scale)
    return mods.apply_score_mod(ops, score_mod, scores, block, ops.shape(q)[0])


def dot_product_scores(ops: Ops, queries: Tensor, keys: Tensor, scale: float) -> Tensor:
    """a(q, k) = q^T k / sqrt(d): (B, [H,] Q, d), (B, [H,] K, d) -> (B, [H,] Q, K); keys may
    have fewer heads, each shared by a group of query heads (``heads``)."""
    return heads.scaled_matmul_t(ops, queries, keys, scale)


def additive_scores(
    ops: Ops, q_hidden: Tensor, k_hidden: Tensor, w_v: Tensor, masks: Masks = NO_MASKS
) -> Tensor:
    """a(q, k) = w_v^T tanh(W_q q + W_k k) from the projections W_q q (B, Q, h) and W_k k
    (B, K, h): the features (B, Q, K, h) summed by broadcasting, as d2l does.  Scores of keys
    the masks hide may be anything finite (the masked softmax hides them)."""
    done = specialise.run(ops, "additive_scores", q_hidden, k_hidden, w_v, masks)
    if done is not None:
        return done
    features = ops.tanh(ops.expand_dims(q_hidden, 2) + ops.expand_dims(k_hidden, 1))
    return ops.matmul(features, w_v)


def attend(
    ops: Ops,
    scores: Tensor,
    values: Tensor,
    masks: Masks = NO_MASKS,
    dropout: Dropout = None,
    exact: bool = True,
    rows_may_be_blank: bool = False,
) -> tuple[Tensor, Tensor]:
    """(attention pooling of values by the masked softmax of scores, the weights before
    dropout), for scores the core made itself.  exact=False: only the output is wanted.
    rows_may_be_blank: as in ``masked_weights``."""
    weights, values = masked_weights(
        ops, scores, values, masks, owned=True, exact=exact, rows_may_be_blank=rows_may_be_blank
    )
    return attention_pooling(ops, weights, values, dropout), weights


def masked_weights(
    ops: Ops,
    scores: Tensor,
    values: Optional[Tensor],
    masks: Masks,
    owned: bool,
    exact: bool = True,
    rows_may_be_blank: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """(the masked softmax of scores, values with the rows no query may see set to 0).
    owned: the scores are the core's own, and may be written.  exact=False: only the output
    is wanted, so with one length per sequence a row with nothing visible may keep any
    weights: its sequence's values are all hidden, hence zeroed, and its output still 0.
    rows_may_be_blank: some row's scores may be -inf, all of them even: such a row gets weights
    0 (the one rule for rows with nothing to attend to), by the formula and ``softmax_of_finite``
    (where the frameworks' softmax would give NaN), no specialisation."""
    if not rows_may_be_blank:
        done = specialise.run(ops, "masked_softmax", scores, values, masks, owned, exact)
        if done is not None:
            return done
        return softmax_where(ops, scores, values, masks, exact, where=ops.where, softmax=ops.softmax)
    softmax = functools.partial(softmax_of_finite, ops)
    return softmax_where(ops, scores, values, masks, exact, where=ops.where, softmax=softmax)


def softmax_of_finite(ops: Ops, x: Tensor) -> Tensor:
    """Softmax over the last axis from the primitives, exactly 0 where x is -inf and over a
    row of -inf (where the frameworks' softmax gives NaN, or a denormal for exp(-inf))."""
    top = ops.max(ops.widen(x), -1)
    e = ops.exp(ops.widen(x) - ops.maximum(top, ops.lowest(top)))
    e = ops.where(x != -math.inf, e, 0.0)
    return ops.cast(e / ops.maximum(ops.sum(e, -1), 1e-18), x)


def holds_non_finite(ops: Ops, x: Tensor) -> bool:
    """Whether x, read on the host, holds a NaN or an inf: the row rule's cue to compute a
    call again.  False where x cannot be read (traced: jit, tf.function, torch.compile),
    where the first answer stands."""
    host = ops.host_values(x)
    return host is not None and not bool((host * 0 == 0).all())  # x * 0 is NaN where x is not finite


def softmax_where(
    ops: Ops,
    X: Tensor,
    values: Optional[Tensor],
    masks: Masks,
    exact: bool = True,
    *,
    where: Callable[[Tensor, Tensor, float], Tensor],
    softmax: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Optional[Tensor]]:
    """``masked_weights`` by its formula, with the ``where`` and ``softmax`` given (the
    primitives, or an adapter's passes that write into scores the core owns).  The fill is
    the dtype's lowest finite value, not -inf (d2l: -1e6), so a fully masked row stays free
    of NaN; the second ``where`` makes it all zeros."""
    mask = visibility(ops, masks, X)
    if mask is None:
        return softmax(X), values
    weights = softmax(where(mask, X, ops.lowest(X)))
    if exact or not masks.one_length_per_sequence:
        weights = where(mask, weights, 0.0)
    return weights, values if values is None else visible_values(ops, values, mask)


def attention_pooling(ops: Ops, weights: Tensor, values: Tensor, dropout: Dropout = None) -> Tensor:
    """f(q, (k_1, v_1), ..., (k_m, v_m)) = sum_i alpha(q, k_i) v_i, dropout on the weights."""
    return heads.matmul(ops, weights if dropout is None else dropout(weights), values)


def linear(ops: Ops, x: Tensor, W: Tensor, b: Tensor = None) -> Tensor:
    """W x + b for every row of x: x (..., in), W (out, in), b (out,) or None."""
    y = ops.matmul_t(x, W)
    return y if b is None else y + b


def nothing_to_attend(ops: Ops, queries: Tensor, keys: Tensor) -> bool:
    """Some dimension of the scores (B, [H,] Q, K) is 0 (some frameworks abort on empty
    kernels, so no kernel runs)."""
    return 0 in ops.shape(queries)[:-1] or ops.shape(keys)[-2] == 0


def no_attention(ops: Ops, queries: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """The answer where some dimension is 0: no keys means every row fully masked, so 0."""
    rows, n_keys, width = ops.shape(queries)[:-1], ops.shape(keys)[-2], ops.shape(values)[-1]
    return ops.zeros(tuple(rows) + (width,), values), ops.zeros(tuple(rows) + (n_keys,), values)
