"""Argument checks of the attention functions: each error names the argument, the
expected and the actual value.  Framework-free, through ``protocol.Ops``."""

from __future__ import annotations

import re
from typing import Any

from .protocol import Ops, Shape, Tensor


class InputDtypeError(TypeError, ValueError):
    """An argument has a dtype the math cannot use (both a TypeError and a ValueError)."""


def same(a: Any, b: Any) -> bool:
    """Equal, or at least one unknown (a traced dimension)."""
    return a is None or b is None or a == b


def fmt(shape: Shape) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + (",)" if len(shape) == 1 else ")")


def dtype_name(x: Tensor) -> str:
    """'float32' for torch.float32, tf's <dtype: 'float32'>, mxnet's <class 'numpy.float32'>, ..."""
    text = re.sub(r"^<(?:dtype:|class) '(.*)'>$", r"\1", str(getattr(x, "dtype", type(x).__name__)))
    return text.rsplit(".", 1)[-1]


def check_float(ops: Ops, arg: str, x: Tensor) -> None:
    if ops.dtype_kind(x) != "f":
        raise InputDtypeError(f"{arg} must have a floating dtype, got {getattr(x, 'dtype', type(x))}")


def check_valid_lens(ops: Ops, valid_lens: Tensor, batch: Any, queries: Any) -> Shape:
    shape = ops.shape(valid_lens)
    ok = (len(shape) == 1 and same(shape[0], batch)) or (
        len(shape) == 2 and same(shape[0], batch) and same(shape[1], queries)
    )
    if not ok:
        raise ValueError(
            f"valid_lens must have shape {fmt((batch,))} (batch,) or {fmt((batch, queries))} "
            f"(batch, queries), got {fmt(shape)}"
        )
    if ops.dtype_kind(valid_lens) not in "iuf":
        raise InputDtypeError(
            f"valid_lens must have an integer or float dtype, got {getattr(valid_lens, 'dtype', '?')}"
        )
    return shape


def check_scores(ops: Ops, X: Tensor, valid_lens: Tensor) -> Shape:
    """The arguments of masked_softmax; returns X's shape."""
    check_float(ops, "X", X)
    shape = ops.shape(X)
    if valid_lens is not None:
        if len(shape) != 3:
            raise ValueError(
                f"X must be 3-D (batch, queries, keys) when valid_lens is given, got shape {fmt(shape)}"
            )
        check_valid_lens(ops, valid_lens, shape[0], shape[1])
    return shape


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
        and queries.dtype == keys.dtype == values.dtype
    ):
        if valid_lens is not None:
            check_valid_lens(ops, valid_lens, q_shape[0], q_shape[1])
        return q_shape, k_shape, v_shape
    _full_check(ops, (queries, keys, values), valid_lens, query_size, key_size, same_width)
    return q_shape, k_shape, v_shape


def _full_check(
    ops: Ops, tensors: tuple, valid_lens: Tensor, query_size: Any, key_size: Any, same_width: bool
) -> None:
    names = ("queries", "keys", "values")
    shapes = [ops.shape(t) for t in tensors]
    for arg, shape, rows in zip(names, shapes, ("queries", "keys", "keys")):
        if len(shape) != 3:
            raise ValueError(f"{arg} must be 3-D (batch, {rows}, features), got shape {fmt(shape)}")
    for arg, x in zip(names, tensors):
        check_float(ops, arg, x)
    if not tensors[0].dtype == tensors[1].dtype == tensors[2].dtype:
        raise InputDtypeError(
            "queries, keys and values must share one dtype, got "
            + ", ".join(f"{arg} {dtype_name(x)}" for arg, x in zip(names, tensors))
        )
    (batch, n_queries, q_width), (_, n_keys, k_width), _ = shapes
    for arg, shape in zip(names[1:], shapes[1:]):
        if not same(shape[0], batch):
            raise ValueError(f"{arg} must have batch size {batch} like queries, got shape {fmt(shape)}")
    if not same(shapes[2][1], n_keys):
        raise ValueError(
            f"values must have {n_keys} rows like keys (one value per key), got shape {fmt(shapes[2])}"
        )
    if same_width and not same(k_width, q_width):
        raise ValueError(
            f"keys must have width {q_width} like queries (dot-product attention), got shape {fmt(shapes[1])}"
        )
    if same_width and q_width == 0:
        raise ValueError("queries must have a non-zero width (the scores are divided by sqrt(width))")
    for arg, label, size, width, shape in (
        ("queries", "query_size", query_size, q_width, shapes[0]),
        ("keys", "key_size", key_size, k_width, shapes[1]),
    ):
        if size is not None and not same(width, size):
            raise ValueError(f"{arg} must have width {label}={size}, got shape {fmt(shape)}")
    if valid_lens is not None:
        check_valid_lens(ops, valid_lens, batch, n_queries)


def check_known_width(q_shape: Shape) -> int:
    """The query width, which the scores are divided by the square root of."""
    if q_shape[-1] is None:  # a graph traced with an unknown feature axis
        raise ValueError(
            "queries must have a known width (the scores are divided by sqrt(width)), "
            f"got shape {fmt(q_shape)}"
        )
    return q_shape[-1]


def check_additive_weights(
    ops: Ops, W_q: Tensor, W_k: Tensor, w_v: Tensor, queries: Tensor
) -> tuple[int, int]:
    """Canonical additive weights W_q (h, query_size), W_k (h, key_size), w_v (h,) in the
    queries' dtype; returns (query_size, key_size)."""
    shapes = []
    for arg, x, rank, layout in (
        ("W_q", W_q, 2, "(num_hiddens, query_size)"),
        ("W_k", W_k, 2, "(num_hiddens, key_size)"),
        ("w_v", w_v, 1, "(num_hiddens,)"),
    ):
        shape = ops.shape(x)
        if len(shape) != rank:
            raise ValueError(f"{arg} must have shape {layout}, got {fmt(shape)}")
        check_float(ops, arg, x)
        if getattr(queries, "dtype", None) is not None and not x.dtype == queries.dtype:
            raise InputDtypeError(
                f"{arg} must have the dtype of queries ({dtype_name(queries)}), got {dtype_name(x)}"
            )
        shapes.append(shape)
    (h, query_size), (h_k, key_size), (h_v,) = shapes
    if not (same(h, h_k) and same(h, h_v)):
        raise ValueError(
            "W_q, W_k and w_v must share num_hiddens (their first dimension), got shapes "
            f"{fmt(shapes[0])}, {fmt(shapes[1])}, {fmt(shapes[2])}"
        )
    return query_size, key_size


def is_empty(shape: Shape) -> bool:
    return 0 in shape
