"""The entry points: check the arguments, pick one way to run the math, run it.

Each strategy below is a whole step that gives what its ``core`` function gives
(within the dtype's rounding; the tests hold each to ``core`` and to the float64
reference), and each is chosen once per call, by the adapter's answers to the
optional steps of ``protocol.Ops``:

* **fused kernel** (``ops.can_fuse``): dot-product attention without weights or
  dropout, at sizes from ``ops.fused_min_scores``;
* **padding written directly** (``ops.host_lengths`` gives the lengths): the masked
  scores and weights are set by ``ops.fill_padding`` (one slice per sequence, or the
  framework's kernel) instead of two masked passes over every score;
* **each sequence over its visible keys** (``ops.visible_key_lengths`` gives the lengths,
  which hide at least ``1 - VISIBLE_KEYS_MAX_SHARE`` of the keys): the padded keys' scores are
  never made (``ops.attend_visible_keys``, with the weights or without; tried before the fused
  kernel);
* **masked where in the scores' memory**: ``core``'s masked softmax with
  ``where_owned``/``softmax_owned``, which may reuse the scores the core made itself;
* **additive scores in blocks of queries** (above ``ops.feature_block_elements``):
  the features of one block at a time, in the adapter's layout (``hiddens_innermost``);
* **additive features over each sequence's visible keys** (``ops.additive_key_lengths`` gives the
  lengths, which hide at least ``1 - VISIBLE_KEYS_MAX_SHARE`` of the keys): no features are
  made for keys that no query of the sequence may see.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional

from . import core, validation
from .core import Dropout
from .protocol import Ops, Tensor, clip_lengths


class Masks(NamedTuple):
    """What hides a key from a query: lengths (B,) or (B, Q), a boolean mask, causality."""

    valid_lens: Tensor = None
    attention_mask: Tensor = None
    causal: bool = False

    @property
    def none(self) -> bool:
        return self.valid_lens is None and self.attention_mask is None and not self.causal

    @property
    def only_lengths(self) -> bool:
        return self.valid_lens is not None and self.attention_mask is None and not self.causal


NO_MASKS = Masks()


def masked_softmax(
    ops: Ops, X: Tensor, valid_lens: Tensor = None, attention_mask: Tensor = None, causal: bool = False
) -> Tensor:
    """``core.masked_softmax`` for the caller's X, which is never written."""
    shape, attention_mask = validation.check_scores(ops, X, valid_lens, attention_mask, causal)
    if validation.is_empty(shape):
        return ops.zeros(shape, X)
    if Masks(valid_lens, attention_mask, causal).only_lengths:
        lengths = _host_lengths(ops, X, valid_lens, shape[-1])
        if lengths is not None:
            return softmax_writing_padding(ops, ops.copy(X), lengths)
    return core.masked_softmax(ops, X, valid_lens, attention_mask, causal)


def dot_product_attention(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor = None,
    dropout: Dropout = None,
    need_weights: bool = True,
    attention_mask: Tensor = None,
    causal: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """``core.dot_product_attention``; need_weights=False allows the fused kernel and
    returns None for the weights."""
    q_shape, k_shape, _ = validation.check_attention_inputs(
        ops, queries, keys, values, valid_lens, same_width=True
    )
    masks = _checked_masks(ops, valid_lens, attention_mask, causal, q_shape[:2] + k_shape[1:2])
    if validation.is_empty(q_shape[:2] + k_shape[1:2]):
        return _empty_attention(ops, queries, keys, values)
    scale = 1.0 / math.sqrt(validation.check_known_width(q_shape))
    return scaled_dot_product(ops, queries, keys, values, masks, scale, dropout, need_weights)


def additive_attention(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor = None,
    *,
    project_q: Callable[[Tensor], Tensor],
    project_k: Callable[[Tensor], Tensor],
    w_v: Tensor,
    query_size: Any = None,
    key_size: Any = None,
    dropout: Dropout = None,
    attention_mask: Tensor = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """``core.additive_attention`` with the projections W_q q, W_k k given as functions
    (a layer's own linear maps); query_size/key_size: the widths they take."""
    q_shape, k_shape, _ = validation.check_attention_inputs(
        ops, queries, keys, values, valid_lens, query_size=query_size, key_size=key_size
    )
    masks = _checked_masks(ops, valid_lens, attention_mask, causal, q_shape[:2] + k_shape[1:2])
    if validation.is_empty(q_shape[:2] + k_shape[1:2]):
        return _empty_attention(ops, queries, keys, values)
    q_hidden, k_hidden = project_q(queries), project_k(keys)
    lengths = _additive_visible_key_lengths(ops, q_hidden, k_hidden, masks)
    if lengths is None:
        scores = additive_scores(ops, q_hidden, k_hidden, w_v)
    else:
        scores = additive_scores_over_visible_keys(ops, q_hidden, k_hidden, w_v, lengths)
    return attend(ops, scores, values, masks, dropout)


def additive_attention_from_weights(
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
    """Additive attention with canonical weights W_q (h, q), W_k (h, k), w_v (h,)."""
    query_size, key_size = validation.check_additive_weights(ops, W_q, W_k, w_v, queries)
    return additive_attention(
        ops, queries, keys, values, valid_lens,
        project_q=lambda q: ops.matmul_t(q, W_q), project_k=lambda k: ops.matmul_t(k, W_k),
        w_v=w_v, query_size=query_size, key_size=key_size, dropout=dropout,
        attention_mask=attention_mask, causal=causal,
    )  # fmt: skip


def multi_head_attention(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor = None,
    *,
    project: Mapping[str, Callable[[Tensor], Tensor]],
    num_heads: int,
    num_hiddens: int,
    sizes: tuple = (None, None, None),
    dropout: Dropout = None,
    need_weights: bool = True,
    attention_mask: Tensor = None,
    causal: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """``core.multi_head_attention`` with the four projections given as functions by name
    ("q", "k", "v", "o": a layer's own linear maps, or the canonical weights'); sizes: the
    widths of queries, keys and values they take (None: not checked here)."""
    q_shape, k_shape, _ = validation.check_attention_inputs(
        ops, queries, keys, values, valid_lens, query_size=sizes[0], key_size=sizes[1], value_size=sizes[2]
    )
    validation.check_num_heads(num_heads, num_hiddens)
    batch, n_queries, n_keys = q_shape[0], q_shape[1], k_shape[1]
    masks = _checked_masks(ops, valid_lens, attention_mask, causal, (batch, num_heads, n_queries, n_keys))
    if validation.is_empty((batch, n_queries)):
        return ops.zeros((batch, n_queries, num_hiddens), queries), ops.zeros(
            (batch, num_heads, n_queries, n_keys), queries
        )
    if n_keys == 0:  # every row fully masked: the heads give 0
        heads = ops.zeros((batch, n_queries, num_hiddens), queries)
        return project["o"](heads), ops.zeros((batch, num_heads, n_queries, 0), queries)
    q, k, v = (ops.split_heads(project[n](x), num_heads) for n, x in zip("qkv", (queries, keys, values)))
    scale = 1.0 / math.sqrt(num_hiddens // num_heads)
    out, weights = scaled_dot_product(ops, q, k, v, masks, scale, dropout, need_weights)
    return project["o"](ops.merge_heads(out)), weights


def multi_head_attention_from_weights(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor = None,
    *,
    weights: Mapping[str, Tensor],
    num_heads: int,
    dropout: Dropout = None,
    need_weights: bool = True,
    attention_mask: Tensor = None,
    causal: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """Multi-head attention with the canonical weights W_q (h, q), W_k (h, k), W_v (h, v),
    W_o (h, h) and, with biases, b_q, b_k, b_v, b_o (h,)."""
    validation.check_attention_inputs(ops, queries, keys, values, valid_lens)
    validation.check_multi_head_weights(ops, weights, num_heads, queries, keys, values)
    project = {
        n: functools.partial(core.linear, ops, W=weights["W_" + n], b=weights.get("b_" + n)) for n in "qkvo"
    }
    return multi_head_attention(
        ops, queries, keys, values, valid_lens, project=project, num_heads=num_heads,
        num_hiddens=ops.shape(weights["W_q"])[0], dropout=dropout, need_weights=need_weights,
        attention_mask=attention_mask, causal=causal,
    )  # fmt: skip


# -- the strategies -----------------------------------------------------------------------


def scaled_dot_product(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    masks: Masks,
    scale: float,
    dropout: Dropout = None,
    need_weights: bool = True,
) -> tuple[Tensor, Optional[Tensor]]:
    """Checked inputs (B, [H,] n, d): each sequence over its visible keys where the adapter
    does that, else the fused kernel where it may run, else scores, the masked softmax and the
    pooling (``attend``)."""
    lengths = _visible_key_lengths(ops, queries, keys, values, masks) if dropout is None else None
    if lengths is not None:
        out, weights = ops.attend_visible_keys(queries, keys, values, lengths, scale, need_weights)
        if ops.all_finite(out):  # else some visible scores or values are not finite: the ways below
            return out, weights
    if not need_weights and dropout is None and _fuses(ops, queries, keys, values):
        return fused_attention(ops, queries, keys, values, masks, scale), None
    scores = ops.scaled_matmul_t(queries, keys, scale)
    out, weights = attend(ops, scores, values, masks, dropout, need_weights)
    return out, (weights if need_weights else None)


def attend(
    ops: Ops,
    scores: Tensor,
    values: Tensor,
    masks: Masks = NO_MASKS,
    dropout: Dropout = None,
    need_weights: bool = True,
) -> tuple[Tensor, Tensor]:
    """``core.attend`` for scores the core made itself (so they may be written).
    need_weights=False: the weights may be inexact in rows where nothing is visible."""
    if masks is NO_MASKS or masks.none:
        weights = ops.softmax_owned(scores)
        return core.attention_pooling(ops, weights, values, dropout), weights
    only_lengths = masks.only_lengths
    lengths = _host_lengths(ops, scores, masks.valid_lens, ops.shape(scores)[-1]) if only_lengths else None
    if lengths is not None:
        weights = softmax_writing_padding(ops, scores, lengths)
        values = _visible_values(ops, values, None, lengths)
    else:
        # Without the weights, per-sequence lengths need no exact zeros: the padded value
        # rows are zeroed, so a row with nothing visible weighs only those, and gives 0.
        exact = need_weights or not only_lengths or len(ops.shape(masks.valid_lens)) != 1
        mask = core.visibility(ops, scores, *masks)
        weights = masked_softmax_in_place(ops, scores, mask, exact)
        values = core.visible_values(ops, values, mask)
    return core.attention_pooling(ops, weights, values, dropout), weights


def softmax_writing_padding(ops: Ops, x: Tensor, lengths: list) -> Tensor:
    """``core.masked_softmax`` of x, the core's own, with the padding written directly
    (``ops.fill_padding``): the dtype's lowest before the softmax, 0 after it.  Every masked
    score is the same, so a row's masked weights are equal and mostly 0 already (exp
    underflows): the second fill skips those (uniform)."""
    weights = ops.softmax_owned(ops.fill_padding(x, lengths, ops.lowest(x)))
    return ops.fill_padding(weights, lengths, 0.0, uniform=True)


def masked_softmax_in_place(ops: Ops, x: Tensor, mask: Tensor, exact: bool = True) -> Tensor:
    """``core.softmax_where`` of x, the core's own, each step allowed to reuse its memory.
    exact=False skips the final zeroing (see ``attend``)."""
    weights = ops.softmax_owned(ops.where_owned(mask, x, ops.lowest(x)))
    return ops.where_owned(mask, weights, 0.0) if exact else weights


def fused_attention(
    ops: Ops, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks, scale: float
) -> Tensor:
    """The output of ``core.dot_product_attention`` from the framework's fused kernel, with
    the same guarantees: nothing from the padding reaches an output (kernels add the mask to
    NaN scores), and fully masked rows are 0 (kernels spread them uniformly)."""
    if masks.none:
        return ops.fused_attention(queries, keys, values, None, scale)
    q_shape, k_shape = ops.shape(queries), ops.shape(keys)
    parts = []  # core.visibility's masks, built from the keys: there are no scores
    if masks.valid_lens is not None:
        parts.append(ops.length_mask(keys, masks.valid_lens, axis=-2))
    if masks.attention_mask is not None:
        parts.append(masks.attention_mask)
    if masks.causal:
        parts.append(ops.causal_mask(q_shape[-2], k_shape[-2], queries))
    mask = core.all_of(ops, parts, len(q_shape))
    lengths = _host_lengths(ops, keys, masks.valid_lens, k_shape[-2]) if masks.only_lengths else None
    keys = _visible_values(ops, keys, mask, lengths)
    values = _visible_values(ops, values, mask, lengths)
    # a prefix of lengths shows the first key if any: one column tells which rows see nothing
    seen = mask[..., :1] if masks.only_lengths else ops.any(mask, -1)
    return ops.where(seen, ops.fused_attention(queries, keys, values, mask, scale), 0.0)


def additive_scores(ops: Ops, q_hidden: Tensor, k_hidden: Tensor, w_v: Tensor) -> Tensor:
    """``core.additive_scores``, in blocks of queries of at most ``ops.feature_block_elements``
    features, so that the extra memory stays a block instead of the whole feature tensor."""
    batch, n_queries, hiddens = ops.shape(q_hidden)
    per_query = (batch or 1) * (hiddens or 1) * (ops.shape(k_hidden)[1] or 1)
    block = ops.feature_block_elements
    if n_queries is None or n_queries * per_query <= block:
        return core.additive_scores(ops, q_hidden, k_hidden, w_v)
    return additive_scores_in_blocks(ops, q_hidden, k_hidden, w_v, max(1, block // per_query))


def additive_scores_over_visible_keys(
    ops: Ops, q_hidden: Tensor, k_hidden: Tensor, w_v: Tensor, lengths: list
) -> Tensor:
    """``additive_scores`` of each sequence over its first lengths[b] keys only, the other
    scores 0 (for the masked softmax to hide): no features are made for keys that no query of
    the sequence may see."""
    n_queries, n_keys = ops.shape(q_hidden)[1], ops.shape(k_hidden)[1]
    rows = []
    for b, n in enumerate(lengths):
        parts = [additive_scores(ops, q_hidden[b : b + 1], k_hidden[b : b + 1, :n], w_v)] if n else []
        if n < n_keys:
            parts.append(ops.zeros((1, n_queries, n_keys - n), q_hidden))
        rows.append(ops.concat(parts, -1) if len(parts) > 1 else parts[0])
    return ops.concat(rows, 0)


def additive_scores_in_blocks(ops: Ops, q_hidden: Tensor, k_hidden: Tensor, w_v: Tensor, step: int) -> Tensor:
    """``core.additive_scores`` block by block (``ops.map_query_blocks``), the features laid
    out (B, q, h, K) by default: keys innermost, the sum adds one number to each row of keys
    and w_v contracts as one (1, h) @ (h, K) product; d2l's (B, q, K, h) where the adapter
    prefers it (``hiddens_innermost``)."""
    # tanh(z) = 2 sigmoid(2z) - 1 where sigmoid is cheaper: the 2s go into the (small)
    # projections and w_v, and the -sum(w_v) is left out (every score of a row shifts alike,
    # which the softmax ignores: the scores are core's plus sum(w_v), the weights the same).
    by_sigmoid = ops.tanh_by_sigmoid(q_hidden)
    if by_sigmoid:
        q_hidden, k_hidden, w_v = q_hidden * 2.0, k_hidden * 2.0, w_v * 2.0
    activation = ops.sigmoid_of_sum if by_sigmoid else ops.tanh_of_sum
    if ops.hiddens_innermost:
        k_side, q_axis = ops.expand_dims(k_hidden, 1), 2  # (B, 1, K, h)

        def contract(features: Tensor) -> Tensor:  # (B, q, K, h) -> (B, q, K)
            return ops.matmul(features, w_v)

    else:
        k_side, q_axis = ops.expand_dims(ops.matrix_transpose(k_hidden), 1), 3  # (B, 1, h, K)
        w_row = ops.expand_dims(w_v, 0)  # (1, h)

        def contract(features: Tensor) -> Tensor:  # (B, q, h, K) -> (B, q, K)
            return ops.matmul(w_row, features)[:, :, 0, :]

    buffers: list = []  # where the activation may keep a dead block's features to reuse

    def score_block(q_block: Tensor) -> Tensor:  # (B, q, h) -> (B, q, K)
        return contract(activation(ops.expand_dims(q_block, q_axis), k_side, buffers))

    return ops.map_query_blocks(score_block, q_hidden, step)


# -- helpers ------------------------------------------------------------------------------


def _checked_masks(
    ops: Ops, valid_lens: Tensor, attention_mask: Tensor, causal: Any, scores_shape: tuple
) -> Masks:
    if attention_mask is None and causal is False:  # the common case, in two comparisons
        return NO_MASKS if valid_lens is None else Masks(valid_lens)
    validation.check_causal(causal)
    return Masks(valid_lens, validation.check_attention_mask(ops, attention_mask, scores_shape), causal)


# Each sequence's additive features over its visible keys pay for the loop over the sequences
# from this many features per sequence (queries x hiddens x keys).
ADDITIVE_VISIBLE_KEYS_MIN_FEATURES = 1 << 16


def _additive_visible_key_lengths(
    ops: Ops, q_hidden: Tensor, k_hidden: Tensor, masks: Masks
) -> Optional[list]:
    """The clipped lengths where the additive features are made per sequence over its visible
    keys: lengths alone, one per sequence, readable on the host, on large enough sequences,
    hiding enough of the keys; else None."""
    if not masks.only_lengths:
        return None
    _, n_queries, hiddens = ops.shape(q_hidden)
    n_keys = ops.shape(k_hidden)[1]
    if (
        None in (n_queries, hiddens, n_keys)
        or n_queries * hiddens * n_keys < ADDITIVE_VISIBLE_KEYS_MIN_FEATURES
    ):
        return None
    return _hiding_enough(ops.additive_key_lengths(q_hidden, k_hidden, masks.valid_lens), n_keys)


# Attending each sequence over its visible keys pays for the loop's smaller products only
# where the batch hides at least this share of its keys (measured on torch; the additive
# features over the visible keys take the same share).
VISIBLE_KEYS_MAX_SHARE = 0.85


def _visible_key_lengths(
    ops: Ops, queries: Tensor, keys: Tensor, values: Tensor, masks: Masks
) -> Optional[list]:
    """The clipped lengths where ``ops.attend_visible_keys`` runs: lengths alone, one per
    sequence, which hide enough of the keys; else None."""
    if not masks.only_lengths:
        return None
    return _hiding_enough(
        ops.visible_key_lengths(queries, keys, values, masks.valid_lens), ops.shape(keys)[-2]
    )


def _hiding_enough(raw: Optional[list], n_keys: int) -> Optional[list]:
    """The lengths an adapter read (or None), clipped, where they hide enough of the keys."""
    if raw is None:
        return None
    lengths = clip_lengths(raw, n_keys)
    return lengths if sum(lengths) <= VISIBLE_KEYS_MAX_SHARE * n_keys * len(lengths) else None


def _fuses(ops: Ops, queries: Tensor, keys: Tensor, values: Tensor) -> bool:
    """The one predicate of the fused path: the kernel takes these inputs at this size."""
    scores_shape = ops.shape(queries)[:-1] + ops.shape(keys)[-2:-1]
    return _at_least(scores_shape, ops.fused_min_scores) and ops.can_fuse(queries, keys, values)


def _host_lengths(ops: Ops, x: Tensor, valid_lens: Tensor, n_keys: Any) -> Optional[list]:
    raw = ops.host_lengths(x, valid_lens)
    return None if raw is None else clip_lengths(raw, n_keys)


def _visible_values(ops: Ops, values: Tensor, mask: Optional[Tensor], lengths: Optional[list]) -> Tensor:
    """``core.visible_values``; with host lengths (exact weights) a finite tensor needs no
    zeroing, since 0 * x is 0, and the rows are zeroed by ``ops.zero_padded_rows`` otherwise."""
    if lengths is None:
        return core.visible_values(ops, values, mask)
    return values if ops.all_finite(values) else ops.zero_padded_rows(values, lengths)


def _at_least(shape: tuple, elements: int) -> bool:
    """Whether a tensor of this shape has at least ``elements`` elements (unknown
    dimensions, as in a symbolic graph, count as large)."""
    total = 1
    for size in shape:
        if size is None:
            return True
        total *= size
    return total >= elements


def _empty_attention(ops: Ops, queries: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """Some dimension is 0: outputs of the right shape without running any kernel (some
    frameworks abort on empty tensors).  No keys at all: every row is fully masked, so 0."""
    (batch, n_queries, _), n_keys, width = ops.shape(queries), ops.shape(keys)[1], ops.shape(values)[-1]
    return ops.zeros((batch, n_queries, width), values), ops.zeros((batch, n_queries, n_keys), values)
