"""Grouped-query attention without repeating keys and values.

With H query heads and H_kv = H / G key/value heads, query head h uses key/value head
h // G (torch's ``enable_gqa``, Keras', jax's and mlx's order).  The G query heads of one
group are stacked as rows, (B, H, n, d) -> (B, H_kv, G n, d) (a reshape: head h = j G + g is
group j's g-th block of rows), so that each product with a key or value head is one
ordinary batched matmul over the shared head; every step between the products (masks,
softmax, the online softmax's running state) keeps the (B, H, Q, K) layout.  Where the
heads match (G = 1) each function is the plain product.
"""

from __future__ import annotations

from typing import Any

Tensor = Any
Ops = Any  # adapter.Ops


def groups(ops: Ops, a: Tensor, b: Tensor) -> int:
    """How many of a's heads share one of b's: a (B, H, ., .) against b (B, H_kv, ., .)."""
    a_shape = ops.shape(a)
    if len(a_shape) != 4:
        return 1
    b_shape = ops.shape(b)
    if len(b_shape) != 4 or not a_shape[1] > b_shape[1] > 0:
        return 1
    return a_shape[1] // b_shape[1]


def stacked(ops: Ops, x: Tensor, groups: int) -> Tensor:
    """(B, H, n, y) -> (B, H / G, G n, y): each group's heads as one block of rows."""
    batch, heads, n, width = ops.shape(x)
    if n is None or width is None:
        raise ValueError(
            f"grouped heads need the numbers of queries and features known when traced, got shape "
            f"{tuple(ops.shape(x))}"
        )
    # in two passes: a chunked array (dask) splits the heads, then merges them with the rows
    x = ops.reshape(x, (-1, heads // groups, groups, n, width))
    return ops.reshape(x, (-1, heads // groups, groups * n, width))


def unstacked(ops: Ops, x: Tensor, groups: int) -> Tensor:
    """(B, H_kv, G n, y) -> (B, H_kv G, n, y), the inverse of ``stacked``."""
    _, kv_heads, rows, width = ops.shape(x)
    x = ops.reshape(x, (-1, kv_heads, groups, rows // groups, width))  # two passes, as ``stacked``
    return ops.reshape(x, (-1, kv_heads * groups, rows // groups, width))


def matmul_t(ops: Ops, a: Tensor, b: Tensor) -> Tensor:
    """a b^T per head, a's heads (B, H, n, d) sharing b's (B, H / G, m, d): (B, H, n, m)."""
    g = groups(ops, a, b)
    return ops.matmul_t(a, b) if g == 1 else unstacked(ops, ops.matmul_t(stacked(ops, a, g), b), g)


def scaled_matmul_t(ops: Ops, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """scale * a b^T, as ``matmul_t``."""
    g = 1 if len(ops.shape(a)) == 3 else groups(ops, a, b)  # 3-D: one frame fewer (toy sizes)
    if g == 1:
        return ops.scaled_matmul_t(a, b, scale)
    return unstacked(ops, ops.scaled_matmul_t(stacked(ops, a, g), b, scale), g)


def matmul(ops: Ops, a: Tensor, b: Tensor) -> Tensor:
    """a b per head, a's heads (B, H, n, m) sharing b's (B, H / G, m, y): (B, H, n, y)."""
    g = 1 if len(ops.shape(a)) == 3 else groups(ops, a, b)
    return ops.matmul(a, b) if g == 1 else unstacked(ops, ops.matmul(stacked(ops, a, g), b), g)


def summed_tn(ops: Ops, a: Tensor, b: Tensor, kv_heads: int) -> Tensor:
    """a^T b per head, summed over each group's heads: a (B, H, n, m), b (B, H, n, y) ->
    (B, kv_heads, m, y), the gradient with respect to a shared key or value head."""
    heads = ops.shape(a)[1]
    if len(ops.shape(a)) != 4 or heads == kv_heads:
        return ops.matmul(ops.matrix_transpose(a), b)
    g = heads // kv_heads
    return ops.matmul(ops.matrix_transpose(stacked(ops, a, g)), stacked(ops, b, g))
