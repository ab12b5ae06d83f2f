"""MLX backend: ``mlx.nn.Module`` classes over the shared core.

MLX evaluates lazily: ``to_numpy`` forces evaluation.  ``mx.array`` of a
float64 numpy array silently becomes float32 unless a dtype is passed, so
``from_numpy`` always passes the array's own dtype.  MLX's exp/softmax are
float32-accurate even in float64; the README gives the tolerances.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx import nn

from .. import core
from .._registry import tensor_check
from ..core import per_row as _per_row
from ..functional import bind
from ..layers import CanonicalWeights, CanonicalWeightsMixin, check_dropout, check_sizes

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")


class MlxOps:
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
        return mx.arange(x.shape[axis]) < _per_row(lens)

    def where(self, mask, x, fill):
        return mx.where(mask, x, mx.array(fill, dtype=x.dtype))

    def lowest(self, x):
        return float(mx.finfo(x.dtype).min)

    def settle(self, x):
        # mlx is lazy: without this, one graph holds every additive block's features at
        # once (0.99x the textbook's memory).  mx.eval is refused inside mx.compile and
        # mx.vmap: there the blocks stay lazy (allowed, and useful, under mx.grad).
        try:
            mx.eval(x)
        except ValueError:
            pass

    def fused_attention(self, queries, keys, values, mask, scale):
        heads = mx.expand_dims  # mlx's layout is (batch, heads, seq, dim): one head
        out = mx.fast.scaled_dot_product_attention(
            heads(queries, 1),
            heads(keys, 1),
            heads(values, 1),
            scale=scale,
            mask=None if mask is None else heads(mask, 1),
        )[:, 0]
        return out  # the core zeroes fully masked rows, which this kernel spreads uniformly


ops = MlxOps()


_tensors = tensor_check("mlx")


masked_softmax, dot_product_attention, additive_attention = bind(ops)


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


class DotProductAttention(nn.Module):
    """Scaled dot-product attention; dropout in training mode only (``.train()``/``.eval()``)."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True) -> None:
        super().__init__()
        self._rate = check_dropout(dropout)
        self.dropout = nn.Dropout(self._rate)
        self._need_weights = need_weights  # False: mx.fast.scaled_dot_product_attention, no weights
        self._attention_weights: Optional[mx.array] = None

    @property
    def attention_weights(self) -> Optional[mx.array]:
        return self._attention_weights

    def __call__(self, queries, keys, values, valid_lens=None) -> mx.array:
        _tensors(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        dropout = self.dropout if self.training and self._rate > 0 else None
        out, self._attention_weights = core.dot_product_attention(
            ops, queries, keys, values, valid_lens, dropout, self._need_weights
        )
        return out


class AdditiveAttention(CanonicalWeightsMixin, nn.Module):
    """Additive attention with ``nn.Linear(bias=False)``; MLX stores weights (out, in)."""

    def __init__(self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)
        self.W_k = nn.Linear(self.key_size, self.num_hiddens, bias=False)
        self.W_q = nn.Linear(self.query_size, self.num_hiddens, bias=False)
        self.w_v = nn.Linear(self.num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self._attention_weights: Optional[mx.array] = None

    @property
    def attention_weights(self) -> Optional[mx.array]:
        return self._attention_weights

    def _read_weights(self) -> CanonicalWeights:
        return {
            "W_q": to_numpy(self.W_q.weight),
            "W_k": to_numpy(self.W_k.weight),
            "w_v": to_numpy(self.w_v.weight).reshape(-1),
        }

    def _write_weights(self, weights: CanonicalWeights) -> None:
        for key, value in weights.items():
            linear = getattr(self, key)
            linear.weight = from_numpy(value.reshape(linear.weight.shape)).astype(linear.weight.dtype)

    def __call__(self, queries, keys, values, valid_lens=None) -> mx.array:
        _tensors(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        out, self._attention_weights = core.additive_attention(
            ops,
            queries,
            keys,
            values,
            valid_lens,
            project_q=self.W_q,
            project_k=self.W_k,
            w_v=self.w_v.weight[0],
            query_size=self.query_size,
            key_size=self.key_size,
            dropout=self.dropout,
        )
        return out
