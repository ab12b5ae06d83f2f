"""MLX backend: the ops of mlx arrays (layers: ``multiattn.layers.mlx``).

MLX evaluates lazily: ``to_numpy`` forces evaluation.  ``mx.array`` of a
float64 numpy array silently becomes float32 unless a dtype is passed, so
``from_numpy`` always passes the array's own dtype.  MLX's exp/softmax are
float32-accurate even in float64; the README gives the tolerances.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import numpy as np

from .. import fast_paths
from ..functional import bind
from ..protocol import Ops, layer_exports

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")
DTYPE_NOTES: dict = {}


class MlxOps(Ops):
    name = "mlx"

    def shape(self, x):
        return tuple(x.shape)

    def dtype_kind(self, x):
        dtype = x.dtype
        if dtype == mx.bool_:
            return "b"
        if mx.issubdtype(dtype, mx.complexfloating):
            return "c"
        if mx.issubdtype(dtype, mx.floating):
            return "f"
        return "u" if mx.issubdtype(dtype, mx.unsignedinteger) else "i"

    def zeros(self, shape, like):
        return mx.zeros(shape, dtype=like.dtype)

    def any(self, mask, axis):
        return mx.any(mask, axis=axis, keepdims=True)

    def expand_dims(self, x, axis):
        return mx.expand_dims(x, axis)

    def matrix_transpose(self, x):
        return mx.swapaxes(x, -1, -2)

    def concat(self, xs, axis):
        return mx.concatenate(xs, axis=axis)

    def matmul(self, a, b):
        return mx.matmul(a, b)

    def matmul_t(self, a, b):
        return mx.matmul(a, mx.swapaxes(b, -1, -2))

    def tanh(self, x):
        return mx.tanh(x)

    def softmax(self, x):
        return mx.softmax(x, axis=-1, precise=True)  # precise: half types accumulate in float32

    def length_mask(self, x, lens, axis=-1):
        rows = lens.shape + (1, 1) if lens.ndim == 1 else lens.shape + (1,)
        return mx.arange(x.shape[axis]) < lens.reshape(rows)  # a reshape builds faster than [:, None]

    def causal_mask(self, n_queries, n_keys, like):
        return mx.tri(n_queries, n_keys, dtype=mx.bool_)

    def logical_and(self, a, b):
        return mx.logical_and(a, b)

    def split_heads(self, x, num_heads):
        batch, n, width = x.shape
        return x.reshape(batch, n, num_heads, width // num_heads).transpose(0, 2, 1, 3)

    def merge_heads(self, x):
        batch, heads, n, width = x.shape
        return x.transpose(0, 2, 1, 3).reshape(batch, n, heads * width)

    def where(self, mask, x, fill):
        return mx.where(mask, x, fill)  # a Python float is weakly typed: x's dtype stays

    def lowest(self, x):
        return float(mx.finfo(x.dtype).min)

    def cast(self, x, like):
        return x if x.dtype == like.dtype else x.astype(like.dtype)

    def settle(self, x):
        # mlx is lazy: without this one graph holds every additive block's features at once.
        # mx.eval is refused inside mx.compile and mx.vmap: there the blocks stay lazy.
        try:
            mx.eval(x)
        except ValueError:
            pass

    def attend_fused(self, queries, keys, values, masks, scale, dropout, need_weights):
        declined = fast_paths.declines_fused(masks, dropout, need_weights)
        if declined:
            return declined
        return lambda: fast_paths.fused_attention(self, _fused_kernel, queries, keys, values, masks, scale)


def _fused_kernel(queries, keys, values, mask, scale):
    if queries.ndim == 4:  # heads already: mlx's layout is (batch, heads, seq, dim)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    heads = mx.expand_dims  # one head
    return mx.fast.scaled_dot_product_attention(
        heads(queries, 1),
        heads(keys, 1),
        heads(values, 1),
        scale=scale,
        mask=None if mask is None else heads(mask, 1),
    )[:, 0]


ops = MlxOps()
masked_softmax, dot_product_attention, additive_attention, multi_head_attention = bind(ops)
__getattr__ = layer_exports("mlx")


def vjp(fn, args, cotangent):
    """(fn(*args), gradients of sum(fn(*args) * cotangent) with respect to args)."""
    outs, grads = mx.vjp(lambda *xs: fn(*xs), list(args), [cotangent])
    return outs[0], list(grads)


def _mx_dtype(name: str) -> Any:
    return mx.bool_ if name == "bool" else getattr(mx, name)


def from_numpy(array: Any, dtype: Optional[str] = None) -> mx.array:
    """An mx.array in the array's own dtype (mx.array alone would turn float64 into float32)."""
    array = np.asarray(array)
    tensor = mx.array(array, dtype=_mx_dtype(str(array.dtype)))
    return tensor if dtype is None else tensor.astype(_mx_dtype(str(dtype)))


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy copy, evaluated (bfloat16 comes back as float32)."""
    if tensor.dtype == mx.bfloat16:
        tensor = tensor.astype(mx.float32)
    return np.array(tensor)
