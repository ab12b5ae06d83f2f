"""The scoring math of d2l section 11.3, written once for every framework.

Every function takes ``ops``, an object of the ``multiattn.protocol.Ops``
protocol, and never names a framework.  Adapters wrap these functions in
their framework's classes.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, cast

from .protocol import Ops, OptionalOps, Shape, Tensor

Dropout = Optional[Callable[[Tensor], Tensor]]


class InputDtypeError(TypeError, ValueError):
    """An argument has a dtype the math cannot use (both a TypeError and a ValueError)."""


def _same(a: Any, b: Any) -> bool:
    return a is None or b is None or a == b


def _fmt(shape: Shape) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + (",)" if len(shape) == 1 else ")")


def _check_float(ops: Ops, arg: str, x: Tensor) -> None:
    if ops.dtype_kind(x) != "f":
        raise InputDtypeError(f"{arg} must have a floating dtype, got {getattr(x, 'dtype', type(x))}")


def _check_valid_lens(ops: Ops, valid_lens: Tensor, batch: Any, queries: Any) -> Shape:
    shape = ops.shape(valid_lens)
    ok = (len(shape) == 1 and _same(shape[0], batch)) or (
        len(shape) == 2 and _same(shape[0], batch) and _same(shape[1], queries)
    )
    if not ok:
        raise ValueError(
            f"valid_lens must have shape {_fmt((batch,))} (batch,) or {_fmt((batch, queries))} "
            f"(batch, queries), got {_fmt(shape)}"
        )
    if ops.dtype_kind(valid_lens) not in "iuf":
        raise InputDtypeError(
            f"valid_lens must have an integer or float dtype, got {getattr(valid_lens, 'dtype', '?')}"
        )
    return shape


def per_row(lens: Any) -> Any:
    """Lengths (B,) as (B, 1, 1), (B, Q) as (B, Q, 1): against positions (K,) they give the
    (B, 1|Q, K) mask.  Plain indexing, which every framework's tensors support."""
    return lens[:, None, None] if len(lens.shape) == 1 else lens[:, :, None]


def masked_softmax(ops: Ops, X: Tensor, valid_lens: Tensor = None) -> Tensor:
    """Softmax over the last axis of X with positions ``>= valid_len`` set to exactly 0.

    A fully masked row (valid_len <= 0) is all zeros; lengths above the row
    length act as the row length.  The mask is broadcast, never copied per row.
    """
    _check_float(ops, "X", X)
    shape = ops.shape(X)
    if valid_lens is None:
        return ops.zeros(shape, X) if _is_empty(shape) else ops.softmax(X)
    if len(shape) != 3:
        raise ValueError(
            f"X must be 3-D (batch, queries, keys) when valid_lens is given, got shape {_fmt(shape)}"
        )
    _check_valid_lens(ops, valid_lens, shape[0], shape[1])
    if _is_empty(shape):
        return ops.zeros(shape, X)
    return _masked_softmax(ops, X, valid_lens, owned=False)[0]


def _masked_softmax(
    ops: Ops,
    X: Tensor,
    valid_lens: Tensor,
    owned: bool,
    lengths: Optional[list] = None,
    exact: bool = True,
) -> tuple[Tensor, Optional[Tensor], bool]:
    """The masked softmax once the arguments are checked; owned: X is the core's own scores.
    lengths: the visible counts in host memory (``_host_lengths``), or None.
    Returns the weights, the (B, 1|Q, K) mask (None where no mask was needed) and whether
    every masked weight is exactly 0.

    A finite fill (not -inf) keeps fully masked rows and their gradients free of NaN;
    the second fill makes masked weights exactly 0, not just tiny.  exact=False lets the
    masked ``where`` path skip it (see ``attend``): masked weights are then exactly 0
    except in rows where nothing is visible, which are uniform over the padding.
    """
    fill = _padding_filler(ops, valid_lens, owned, lengths)
    filled = None if fill is None else fill(X, ops.lowest(X), owned=owned)
    if filled is not None:
        # filled is the core's own unless the filler found no padding in the caller's X
        weights = _softmax_of(ops, owned or filled is not X)(filled)
        # Every masked score is `lowest`, so a row's masked weights are all equal: already
        # exactly 0 (exp underflows) unless no visible score is much above `lowest` (fully
        # masked rows, visible scores of -inf); uniform lets the filler skip the others.
        refilled = fill(weights, 0.0, uniform=True, owned=True)
        if refilled is not None:
            return refilled, None, True
        mask = ops.length_mask(X, valid_lens)
        return ops.where(mask, weights, 0.0), mask, True
    mask = ops.length_mask(X, valid_lens)  # (B, 1|Q, K)
    where_owned = getattr(ops, "where_owned", ops.where)
    # where never writes into the caller's X: either way the softmax gets the core's own
    weights = _softmax_of(ops, True)((where_owned if owned else ops.where)(mask, X, ops.lowest(X)))
    return (where_owned(mask, weights, 0.0) if exact else weights), mask, exact


def _softmax_of(ops: Ops, owned: bool) -> Any:
    """The softmax for scores the core owns (``softmax_owned``, which may reuse their
    memory for the weights) or for the caller's (never written)."""
    return getattr(ops, "softmax_owned", ops.softmax) if owned else ops.softmax


def _padding_filler(ops: Ops, valid_lens: Tensor, owned: bool, lengths: Optional[list]) -> Any:
    """A function (x, fill, uniform=False, owned=False) giving x with its padding set to fill
    (or None, declined), or None where the masked ``where`` is the way: the adapter's own
    kernel (``fill_padding``, told whether x is the core's own), else slices over host
    lengths.  Slices write into x, so only where the scores are the core's own."""
    fill_padding = getattr(ops, "fill_padding", None)
    if fill_padding is not None:
        return lambda x, fill, uniform=False, owned=False: fill_padding(x, valid_lens, fill, uniform, owned)
    if owned and lengths is not None:
        return lambda x, fill, uniform=False, owned=True: _fill_slices(ops, x, lengths, fill, uniform)
    return None


def _host_lengths(ops: Ops, x: Tensor, valid_lens: Tensor, n_keys: int) -> Optional[list]:
    """How many keys each sequence sees, as Python ints, where the adapter reads the
    lengths for free and lets x be written slice by slice (``ops.host_lengths``); else None.
    Clipped to [0, n_keys]; a fractional length counts the positions j < length (ceil);
    NaN sees nothing (j < NaN is false), as in ``length_mask``."""
    host_lengths = getattr(ops, "host_lengths", None)
    raw = None if host_lengths is None else host_lengths(x, valid_lens)
    if raw is None:
        return None
    return [0 if not n > 0 else n_keys if n >= n_keys else math.ceil(n) for n in raw]


def _fill_slices(ops: Ops, x: Tensor, lengths: list, fill: float, uniform: bool = False) -> Tensor:
    """x (B, Q, K) with x[b, :, lengths[b]:] = fill, written in place, one slice per sequence
    (no pass over the visible scores).  uniform: x holds softmax weights (>= 0, or NaN)
    with one value per row in the padding and fill is 0, so a sequence whose last column
    (its padding) is already 0 everywhere is skipped.  Per sequence, not one maximum for
    all: a sequence without padding (the batch's longest, typically) has weights there."""
    n_keys = ops.shape(x)[-1]
    if uniform:
        # `<=`, not `==`: paddle's float `==` has a tolerance (1e-28 == 0); NaN is not done
        done = (x[:, :, -1] <= fill).all(1).tolist()
        lengths = [n_keys if ok and n > 0 else n for n, ok in zip(lengths, done)]
    for row, n in enumerate(lengths):
        if n < n_keys:
            x[row, :, n:] = fill
    return x


def _zero_rows(ops: Ops, values: Tensor, lengths: list) -> Tensor:
    """values (B, K, v) with the rows >= lengths[b] zeroed: a copy and a slice per sequence."""
    values = cast(OptionalOps, ops).copy(values)  # adapters with host_lengths define copy
    n_keys = ops.shape(values)[1]
    for row, n in enumerate(lengths):
        if n < n_keys:
            values[row, n:] = 0.0
    return values


def _at_least(shape: Shape, elements: int) -> bool:
    """Whether a tensor of this shape has at least ``elements`` elements (unknown
    dimensions, as in a symbolic graph, count as large)."""
    total = 1
    for size in shape:
        if size is None:
            return True
        total *= size
    return total >= elements


def _is_empty(shape: Shape) -> bool:
    return 0 in shape


def _empty_attention(ops: Ops, queries: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """Some dimension is 0: outputs of the right shape without running any kernel (some
    frameworks abort on empty tensors).  No keys at all: every row is fully masked, so 0."""
    (batch, n_queries, _), n_keys, width = ops.shape(queries), ops.shape(keys)[1], ops.shape(values)[-1]
    return ops.zeros((batch, n_queries, width), values), ops.zeros((batch, n_queries, n_keys), values)


def check_attention_inputs(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor = None,
    *,
    query_size: Any = None,
    key_size: Any = None,
    same_width: bool = False,
) -> tuple[Shape, Shape, Shape]:
    """The three shapes; ValueError naming the argument, the expected and the actual shape."""
    q_shape, k_shape, v_shape = ops.shape(queries), ops.shape(keys), ops.shape(values)
    # The common case in a few comparisons (toy sizes are dispatch bound); anything
    # unusual (a mismatch, an unknown dimension, a size argument) takes the full check.
    if (
        len(q_shape) == len(k_shape) == len(v_shape) == 3
        and q_shape[0] == k_shape[0] == v_shape[0] is not None
        and k_shape[1] == v_shape[1] is not None
        and (q_shape[2] == k_shape[2] != 0 if same_width else query_size is key_size is None)
        and ops.dtype_kind(queries) == ops.dtype_kind(keys) == ops.dtype_kind(values) == "f"
    ):
        if valid_lens is not None:
            _check_valid_lens(ops, valid_lens, q_shape[0], q_shape[1])
        return q_shape, k_shape, v_shape
    _check_attention_inputs(ops, queries, keys, values, valid_lens, query_size, key_size, same_width)
    return q_shape, k_shape, v_shape


def _check_attention_inputs(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor,
    query_size: Any,
    key_size: Any,
    same_width: bool,
) -> None:
    names = ("queries", "keys", "values")
    shapes = [ops.shape(t) for t in (queries, keys, values)]
    for arg, shape, rows in zip(names, shapes, ("queries", "keys", "keys")):
        if len(shape) != 3:
            raise ValueError(f"{arg} must be 3-D (batch, {rows}, features), got shape {_fmt(shape)}")
    for arg, x in zip(names, (queries, keys, values)):
        _check_float(ops, arg, x)
    (batch, n_queries, q_width), (_, n_keys, k_width), _ = shapes
    for arg, shape in zip(names[1:], shapes[1:]):
        if not _same(shape[0], batch):
            raise ValueError(f"{arg} must have batch size {batch} like queries, got shape {_fmt(shape)}")
    if not _same(shapes[2][1], n_keys):
        raise ValueError(
            f"values must have {n_keys} rows like keys (one value per key), got shape {_fmt(shapes[2])}"
        )
    if same_width and not _same(k_width, q_width):
        raise ValueError(
            f"keys must have width {q_width} like queries (dot-product attention), "
            f"got shape {_fmt(shapes[1])}"
        )
    if same_width and q_width == 0:
        raise ValueError("queries must have a non-zero width (the scores are divided by sqrt(width))")
    for arg, label, size, width, shape in (
        ("queries", "query_size", query_size, q_width, shapes[0]),
        ("keys", "key_size", key_size, k_width, shapes[1]),
    ):
        if size is not None and not _same(width, size):
            raise ValueError(f"{arg} must have width {label}={size}, got shape {_fmt(shape)}")
    if valid_lens is not None:
        _check_valid_lens(ops, valid_lens, batch, n_queries)


def attend(
    ops: Ops,
    scores: Tensor,
    values: Tensor,
    valid_lens: Tensor = None,
    dropout: Dropout = None,
    need_weights: bool = True,
) -> tuple[Tensor, Tensor]:
    """(masked_softmax(scores) @ values with dropout on the weights, weights before dropout;
    with need_weights=False the weights may be inexact in rows where nothing is visible)."""
    if valid_lens is None:
        weights = _softmax_of(ops, owned=True)(scores)
    else:
        lengths = _host_lengths(ops, scores, valid_lens, ops.shape(scores)[-1])
        # The output alone needs no exact zeros where the lengths are per sequence: the
        # padded value rows are then zeroed (inexact weights rule out the finite shortcut
        # below), and a row with nothing visible (fully masked, or all visible scores -inf)
        # weighs only those rows, so its output is 0 all the same.  Per-query lengths zero
        # only the rows no query sees.
        exact = need_weights or len(ops.shape(valid_lens)) != 1
        weights, mask, exact = _masked_softmax(ops, scores, valid_lens, True, lengths, exact)
        values = _drop_unused_values(ops, values, valid_lens, mask, lengths, exact)
    dropped = weights if dropout is None else dropout(weights)
    return ops.matmul(dropped, values), weights


def _drop_unused_values(
    ops: Ops,
    values: Tensor,
    valid_lens: Tensor,
    mask: Optional[Tensor],
    lengths: Optional[list],
    exact: bool = True,
) -> Tensor:
    """Zero the value rows no query may attend to (padding), so that a NaN or inf there
    cannot reach the output through 0 * NaN in the matmul.  (B, K, v): a small pass.
    mask: the (B, 1|Q, K) length mask, or None to make it here if needed; lengths: the
    host lengths (``_host_lengths``) or None; exact: every masked weight is exactly 0."""
    zero_padded_rows = getattr(ops, "zero_padded_rows", None)
    if lengths is not None and all(n >= ops.shape(values)[1] for n in lengths):
        return values
    # With exact weights 0 * x is 0 for finite x: only a NaN or inf in values needs the
    # zeroing, and a finite sum proves there is none.  Only where the lengths are read on
    # the host anyway (host lengths, the adapter's own kernel): elsewhere it costs a sync.
    if exact and (lengths is not None or zero_padded_rows is not None):
        if math.isfinite(float(values.sum())):
            return values
    dropped = None if zero_padded_rows is None else zero_padded_rows(values, valid_lens)
    if dropped is not None:
        return dropped
    if lengths is not None:
        return _zero_rows(ops, values, lengths)
    if mask is None:
        mask = ops.length_mask(values, valid_lens, axis=1)
    if ops.shape(mask)[1] != 1:  # per-query lengths: a key is used if any query may see it
        mask = ops.any(mask, 1)
    return ops.where(ops.matrix_transpose(mask), values, 0.0)  # (B, 1, K) -> (B, K, 1)


def dot_product_attention(
    ops: Ops,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor = None,
    dropout: Dropout = None,
    need_weights: bool = True,
) -> tuple[Tensor, Optional[Tensor]]:
    """softmax(Q K^T / sqrt(d)) V; returns (output, attention weights).

    With need_weights=False and no dropout, the framework's fused kernel runs
    where the adapter has one (``ops.fused_attention``), and the weights are None.
    """
    q_shape, k_shape, _ = check_attention_inputs(ops, queries, keys, values, valid_lens, same_width=True)
    (_, n_queries, d), n_keys = q_shape, k_shape[1]
    if 0 in (q_shape[0], n_queries, n_keys):
        return _empty_attention(ops, queries, keys, values)
    if d is None:  # a graph traced with an unknown feature axis
        raise ValueError(
            "queries must have a known width (the scores are divided by sqrt(width)), "
            f"got shape {_fmt(q_shape)}"
        )
    scale = 1.0 / math.sqrt(d)
    fused = getattr(ops, "fused_attention", None)
    if (
        not need_weights
        and dropout is None
        and fused is not None
        and _at_least((q_shape[0], n_queries, n_keys), getattr(ops, "fused_min_scores", 0))
    ):
        if valid_lens is None:
            out = fused(queries, keys, values, None, scale)
        else:
            mask = ops.length_mask(keys, valid_lens, axis=1)  # (B, 1|Q, K)
            # the same guarantees as the unfused path: nothing from padding reaches an output
            # (kernels add the mask to NaN scores), and fully masked rows are 0, not uniform
            lengths = _host_lengths(ops, keys, valid_lens, n_keys)
            keys = _drop_unused_values(ops, keys, valid_lens, mask, lengths)
            values = _drop_unused_values(ops, values, valid_lens, mask, lengths)
            out = fused(queries, keys, values, mask, scale)
            out = None if out is None else ops.where(mask[:, :, :1], out, 0.0)
        if out is not None:
            return out, None
    scaled_matmul_t = getattr(ops, "scaled_matmul_t", None)
    if scaled_matmul_t is not None:
        scores = scaled_matmul_t(queries, keys, scale)
    # Scale the smaller operand: queries (B,Q,d) rather than the (B,Q,K) scores when d <= K.
    elif n_keys is not None and d is not None and d <= n_keys:
        scores = ops.matmul_t(queries * scale, keys)
    else:
        scores = ops.matmul_t(queries, keys) * scale
    out, weights = attend(ops, scores, values, valid_lens, dropout, need_weights)
    return out, (weights if need_weights else None)


# Elements of one block of additive features, (B, queries, K, h) or (B, queries, h, K).
# Scores are computed block by block over the queries, so the extra memory stays a few MB
# instead of the whole feature tensor.  An adapter may set its own ``feature_block_elements``
# (cache-sized blocks for an eager CPU framework, bigger ones where each op has a high
# fixed cost).
FEATURE_BLOCK_ELEMENTS = 1 << 20


def additive_scores(ops: Ops, q_hidden: Tensor, k_hidden: Tensor, w_v: Tensor) -> Tensor:
    """w_v^T tanh(W_q q + W_k k) for every (query, key) pair: (B,Q,h), (B,K,h), (h,) -> (B,Q,K).

    The features are laid out (B, Q, h, K), keys innermost: the sum adds one number to each
    row of keys rather than two h-vectors per pair, and w_v contracts the hiddens as one
    (1, h) @ (h, K) product per query (torch, tensorflow, paddle, mlx, mxnet: 7-11% less
    time than d2l's layout).  Adapters that prefer d2l's (B, Q, K, h) say so
    (``hiddens_innermost``)."""
    batch, n_queries, hiddens = ops.shape(q_hidden)
    n_keys = ops.shape(k_hidden)[1]
    if getattr(ops, "hiddens_innermost", False):
        k_side, q_axis = ops.expand_dims(k_hidden, 1), 2  # (B, 1, K, h)

        def contract(features: Tensor) -> Tensor:  # (B, q, K, h) -> (B, q, K)
            return ops.matmul(features, w_v)

    else:
        k_side, q_axis = ops.expand_dims(ops.matrix_transpose(k_hidden), 1), 3  # (B, 1, h, K)
        w_row = ops.expand_dims(w_v, 0)  # (1, h)

        def contract(features: Tensor) -> Tensor:  # (B, q, h, K) -> (B, q, K)
            return ops.matmul(w_row, features)[:, :, 0]

    def score_block(q_block: Tensor) -> Tensor:  # (B, q, h) -> (B, q, K)
        return contract(ops.tanh(ops.expand_dims(q_block, q_axis) + k_side))

    per_query = (batch or 1) * (hiddens or 1) * (n_keys or 1)
    block = getattr(ops, "feature_block_elements", FEATURE_BLOCK_ELEMENTS)
    if n_queries is None or n_queries * per_query <= block:
        return score_block(q_hidden)
    step = max(1, block // per_query)
    map_query_blocks = getattr(ops, "map_query_blocks", None)
    if map_query_blocks is not None:
        scores = map_query_blocks(score_block, q_hidden, step)
        if scores is not None:
            return scores
    tanh_of_sum = getattr(ops, "tanh_of_sum", None)
    settle = getattr(ops, "settle", None)
    blocks, features = [], None
    for start in range(0, n_queries, step):
        q_block = q_hidden[:, start : start + step]
        if tanh_of_sum is None:  # each block's features freed before the next is made
            blocks.append(score_block(q_block))
        else:  # the previous block's features are dead: the adapter may reuse their memory
            features = tanh_of_sum(ops.expand_dims(q_block, q_axis), k_side, features)
            blocks.append(contract(features))
        if settle is not None:  # a lazy framework computes this block now, freeing its features
            settle(blocks[-1])
    return ops.concat(blocks, 1)


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
    query_size: int,
    key_size: int,
    dropout: Dropout = None,
) -> tuple[Tensor, Tensor]:
    """Additive attention; project_q/project_k apply W_q/W_k (the layer's own linear maps)."""
    check_attention_inputs(ops, queries, keys, values, valid_lens, query_size=query_size, key_size=key_size)
    if _is_empty(ops.shape(queries)[:2] + ops.shape(keys)[1:2]):
        return _empty_attention(ops, queries, keys, values)
    scores = additive_scores(ops, project_q(queries), project_k(keys), w_v)
    return attend(ops, scores, values, valid_lens, dropout)


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
) -> tuple[Tensor, Tensor]:
    """Additive attention with weight tensors in the canonical layout:
    W_q (h, query_size), W_k (h, key_size), w_v (h,)."""
    (h, query_size), (h_k, key_size), (h_v,) = _weight_shapes(ops, W_q, W_k, w_v)
    if not (_same(h, h_k) and _same(h, h_v)):
        raise ValueError(
            "W_q, W_k and w_v must share num_hiddens (their first dimension), got shapes "
            f"{_fmt(ops.shape(W_q))}, {_fmt(ops.shape(W_k))}, {_fmt(ops.shape(w_v))}"
        )
    return additive_attention(
        ops,
        queries,
        keys,
        values,
        valid_lens,
        project_q=lambda q: ops.matmul_t(q, W_q),
        project_k=lambda k: ops.matmul_t(k, W_k),
        w_v=w_v,
        query_size=query_size,
        key_size=key_size,
        dropout=dropout,
    )


def _weight_shapes(ops: Ops, W_q: Tensor, W_k: Tensor, w_v: Tensor) -> list[Shape]:
    shapes = []
    for arg, x, rank, layout in (
        ("W_q", W_q, 2, "(num_hiddens, query_size)"),
        ("W_k", W_k, 2, "(num_hiddens, key_size)"),
        ("w_v", w_v, 1, "(num_hiddens,)"),
    ):
        shape = ops.shape(x)
        if len(shape) != rank:
            raise ValueError(f"{arg} must have shape {layout}, got {_fmt(shape)}")
        _check_float(ops, arg, x)
        shapes.append(shape)
    return shapes
