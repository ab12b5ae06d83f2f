"""The primitives every NumPy-like namespace spells the same way (numpy, jax.numpy,
mlx.core): one base, parametrised by the namespace ``xp``, in the manner of einops'
``JaxBackend(NumpyBackend)``; each of those backends sets ``xp`` and overrides what its
framework does differently.  (The Array API backend has its own: the standard's names
differ, and its namespace is found per call.)"""

from __future__ import annotations

from typing import Any

from ..adapter import Ops
from ..protocol import per_row


class NumpyLikeOps(Ops):
    _declares = ("xp", "bool_dtype")  # members beside adapter.Ops' (adapter_problems)
    xp: Any = None  # the namespace: numpy, jax.numpy, mlx.core
    bool_dtype: Any = bool

    def shape(self, x):
        return tuple(x.shape)

    def zeros(self, shape, like):
        return self.xp.zeros(shape, dtype=like.dtype)

    def any(self, mask, axis):
        return self.xp.any(mask, axis=axis, keepdims=True)

    def expand_dims(self, x, axis):
        return self.xp.expand_dims(x, axis)

    def matrix_transpose(self, x):
        return self.xp.swapaxes(x, -1, -2)

    def concat(self, xs, axis):
        return self.xp.concatenate(xs, axis=axis)

    def matmul(self, a, b):
        return self.xp.matmul(a, b)

    def broadcast_to(self, x, shape):
        return self.xp.broadcast_to(x, shape)

    def matmul_t(self, a, b):
        return self.xp.matmul(a, self.xp.swapaxes(b, -1, -2))

    def tanh(self, x):
        return self.xp.tanh(x)

    def length_mask(self, x, lens, axis=-1):
        return self.xp.arange(x.shape[axis]) < per_row(lens)

    def causal_mask(self, n_queries, n_keys, like):
        return self.xp.tri(n_queries, n_keys, dtype=self.bool_dtype)

    def logical_and(self, a, b):
        return self.xp.logical_and(a, b)

    def split_heads(self, x, num_heads):
        batch, n, width = x.shape
        return x.reshape(batch, n, num_heads, width // num_heads).transpose(0, 2, 1, 3)

    def merge_heads(self, x):
        batch, heads, n, width = x.shape
        return x.transpose(0, 2, 1, 3).reshape(batch, n, heads * width)

    def reshape(self, x, shape):
        return x.reshape(tuple(shape))

    def where(self, mask, x, fill):
        return self.xp.where(mask, x, self.xp.asarray(fill, dtype=x.dtype))

    def select(self, condition, x, y):
        return self.xp.where(condition, x, y)

    def positions(self, start, stop, like):
        return self.xp.arange(start, stop)

    def constant(self, values, like):
        return self.xp.asarray(values)

    def lowest(self, x):
        return float(self.xp.finfo(x.dtype).min)

    def cast(self, x, like):
        return x if x.dtype == like.dtype else x.astype(like.dtype)

    def widen(self, x):
        return x.astype(self.xp.float32) if self.xp.finfo(x.dtype).bits < 32 else x

    def exp(self, x):
        return self.xp.exp(x)

    def log(self, x):
        return self.xp.log(x)

    def max(self, x, axis):
        return self.xp.max(x, axis=axis, keepdims=True)

    def sum(self, x, axis):
        return self.xp.sum(x, axis=axis, keepdims=True)

    def maximum(self, a, b):
        return self.xp.maximum(a, b)
