"""The partial state of attention over a set of keys, and its merge: every path's one vocabulary.

A finished state is ``(out, lse)``, FlashInfer's convention and ``return_lse``'s: out (..., Q, v)
the softmax-weighted values over the set's visible keys, lse (..., Q, 1) the log of the sum of
exp of their scores.  While a loop runs, the state is its sums ``(top, total, weighted)``: the
row max of the scores, the sum of exp(s - top) and the values weighted by them (Rabe & Staats'
``summarize_chunk``); a finished state is the sums (lse, 1, out).  A row that sees nothing has
out 0 and lse -inf and weighs nothing in a merge: the row rule, decided here (``finish``).

- ``block_sums``: one block of keys' sums, merged into the running sums where given
  (``merge_sums`` for sums made otherwise: a fused softmax's);
- ``merge_many``: the sums of disjoint sets stacked along an axis, merged and finished
  (``combine_attention``, a decoding step's splits);
- ``finish``: sums to (out, lse).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from . import heads

Tensor = Any
Ops = Any
State = Tuple[Tensor, Tensor]  # (out (..., Q, v), lse (..., Q, 1))
Sums = Tuple[Tensor, Tensor, Tensor]  # (top (..., Q, 1), total (..., Q, 1), weighted (..., Q, v))

NEG_INF = float("-inf")
TINY = 1e-18  # below any total but 0 (>= 1 once a score is visible); its square normal in float32


def finite(ops: Ops, m: Tensor) -> Tensor:
    """m with -inf (nothing visible) as the lowest finite value: exp(-inf - lowest) is 0, where
    exp(-inf - -inf) would be NaN."""
    return ops.maximum(m, ops.lowest(m))


def block_weights(
    ops: Ops, scores: Tensor, seen: Optional[Tensor] = None, top: Optional[Tensor] = None, owned: bool = False
):
    """(row max, exp(s - max), their sum) of a block's scores (..., Q, K); seen: which are
    visible (None: all but those of -inf); top: a running max to take the max with; owned:
    the scores are the caller's own, read no more (their memory may take the weights)."""
    if seen is not None:
        scores, owned = ops.where(seen, scores, NEG_INF), True
    block_top = ops.max(scores, -1)
    top = block_top if top is None else ops.maximum(top, block_top)
    p = ops.exp_minus(scores, finite(ops, top), owned)
    if seen is not None:  # exactly 0: paddle's exp(-inf) is a denormal, and products with them crawl
        p = ops.where(seen, p, 0.0)
    return top, p, ops.sum(p, -1)


def block_sums(
    ops: Ops, scores: Tensor, values: Tensor, seen: Optional[Tensor] = None, running: Optional[Sums] = None,
    owned: bool = False,
) -> Sums:  # fmt: skip
    """One block's sums, merged into the running sums where given: the block's exponentials are
    taken against the merged max, so only the running sums are rescaled (the online softmax).
    owned: the scores are the caller's own, read no more (``block_weights``)."""
    top, p, total = block_weights(ops, scores, seen, None if running is None else running[0], owned)
    weighted = pooled(ops, p, values)
    if running is None:
        return top, total, weighted
    rescale = ops.exp(finite(ops, running[0]) - finite(ops, top))
    return top, rescale * running[1] + total, rescale * running[2] + weighted


def log_sum_exp(ops: Ops, scores: Tensor, seen: Optional[Tensor] = None) -> Tensor:
    """The lse (..., Q, 1) of a block's scores: the state of all its keys without the values."""
    top, _, total = block_weights(ops, scores, seen)
    return top + ops.log(ops.maximum(total, TINY))


def merge_sums(ops: Ops, a: Optional[Sums], b: Sums) -> Sums:
    """The sums over the union of two disjoint sets (a None: b's alone), each rescaled to the
    merged max."""
    if a is None:
        return b
    top = ops.maximum(a[0], b[0])
    r_a, r_b = (ops.exp(finite(ops, x[0]) - finite(ops, top)) for x in (a, b))
    return top, r_a * a[1] + r_b * b[1], r_a * a[2] + r_b * b[2]


def pooled(ops: Ops, p: Tensor, values: Tensor) -> Tensor:
    """p V, the product in the values' dtype (a cache's storage); heads grouped (``heads``)."""
    return ops.widen(heads.matmul(ops, ops.cast(p, values), values))


def finish(ops: Ops, sums: Sums) -> State:
    """(out, lse) from sums: out = weighted / total, lse = top + log total; the row rule."""
    top, total, weighted = sums
    seen_any = top != NEG_INF  # not total > 0: a denormal exp(-inf) would leave it above 0
    total = ops.maximum(total, TINY)  # log(0)'s gradient would be inf, and 0 * inf NaN
    return ops.where(seen_any, weighted / total, 0.0), top + ops.log(total)


def merge_many(ops: Ops, top: Tensor, total: Optional[Tensor], weighted: Tensor, axis: int) -> State:
    """The finished state over disjoint sets whose sums are stacked along axis (kept, of length
    1); total None: finished states (out as weighted, lse as top)."""
    merged = ops.max(top, axis)
    w = ops.exp(top - finite(ops, merged))
    total = ops.sum(w if total is None else total * w, axis)
    return finish(ops, (merged, total, ops.sum(weighted * w, axis)))


def combine(ops: Ops, parts: List[State]) -> State:
    """The finished state over the union of disjoint sets from each set's (out (..., Q, v),
    lse (..., Q)); lse (..., Q) too."""
    if len(parts) == 1:
        return parts[0]
    outs = ops.concat([ops.expand_dims(ops.widen(out), 0) for out, _ in parts], 0)
    lses = ops.concat([ops.expand_dims(ops.expand_dims(ops.widen(lse), -1), 0) for _, lse in parts], 0)
    out, lse = merge_many(ops, lses, None, outs, 0)
    return ops.cast(out[0, ...], parts[0][0]), lse[0, ..., 0]


def weights(ops: Ops, scores: Tensor, lse: Tensor, seen: Optional[Tensor] = None) -> Tensor:
    """A block's softmax weights exp(s - lse) from its row's lse (made ``finite``), 0 where
    seen is False (the backward's P)."""
    p = ops.exp(scores - lse)
    return p if seen is None else ops.where(seen, p, 0.0)


def scores(ops: Ops, queries: Tensor, keys: Tensor, scale: float) -> Tensor:
    """scale Q K^T (heads grouped), differentiated with Q's and K's finite factors: a score made
    -inf by a key of -inf is hidden, its dS 0, and dS K must give 0 there (the row rule's
    gradients), where the framework's own product would give 0 * -inf = NaN."""
    def product(q: Tensor, k: Tensor) -> Tuple[Tensor]:
        return (heads.scaled_matmul_t(ops, q, k, scale),)

    def backward(tensors: tuple, _: tuple, outputs: tuple, cotangents: tuple) -> Tuple[Tensor, Tensor]:
        (q, k), d_s = tensors, cotangents[0]
        kv_heads = ops.shape(k)[1] if len(ops.shape(k)) == 4 else None
        dq = heads.matmul(ops, d_s, finite_factor(ops, k))
        return dq * scale, heads.summed_tn(ops, d_s, finite_factor(ops, q), kv_heads) * scale

    def tangent(tensors: tuple, _: tuple, tangents: tuple) -> Tuple[Tensor]:
        (q, k), (dq, dk) = tensors, tangents
        found = heads.scaled_matmul_t(ops, dq, finite_factor(ops, k), scale)
        return (found + heads.scaled_matmul_t(ops, finite_factor(ops, q), dk, scale),)

    return ops.custom_gradient(product, backward, (queries, keys), tangent=tangent)[0]


def finite_factor(ops: Ops, x: Tensor) -> Tensor:
    """x with its infinite and NaN entries 0, as a factor of the backward's dS K and dS^T Q: a
    score made -inf by a key (or query) of -inf is hidden, its dS 0, and 0 * inf must give 0."""
    return ops.where(x - x == 0.0, x, 0.0)


def empty(ops: Ops, rows: tuple, width: int, like: Tensor) -> Sums:
    """The sums of no keys for rows (..., Q)."""
    zeros = ops.zeros(tuple(rows) + (1,), like)
    return zeros + NEG_INF, zeros, ops.zeros(tuple(rows) + (width,), like)
