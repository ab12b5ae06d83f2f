"""numpy backend: a first-class backend, not only a test reference.

Layers hold numpy parameters, draw their initial weights and dropout masks
from a seedable ``numpy.random.Generator``, and have a ``training`` flag
(``.train()`` / ``.eval()``) like the framework layers.  No autograd.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np

from .. import core
from .._registry import tensor_check
from ..core import per_row as _per_row
from ..functional import bind
from ..layers import CanonicalWeights, CanonicalWeightsMixin, check_dropout, check_sizes

SUPPORTED_DTYPES = ("float32", "float64", "float16")
DTYPE_NOTES = {"bfloat16": "numpy has no bfloat16 dtype"}

Seed = Union[None, int, np.random.Generator]


class NumpyOps:
    name = "numpy"

    def shape(self, x):
        return x.shape

    def dtype_kind(self, x):
        return x.dtype.kind

    def zeros(self, shape, like):
        return np.zeros(shape, dtype=like.dtype)

    def any(self, mask, axis):
        return np.any(mask, axis=axis, keepdims=True)

    def expand_dims(self, x, axis):
        return np.expand_dims(x, axis)

    def matrix_transpose(self, x):
        return np.ascontiguousarray(np.swapaxes(x, -1, -2))  # no copy where an axis has size 1

    def concat(self, xs, axis):
        return np.concatenate(xs, axis=axis)

    def matmul(self, a, b):
        return np.matmul(a, b)

    def matmul_t(self, a, b):
        return np.matmul(a, np.swapaxes(b, -1, -2))

    def tanh(self, x):
        return np.tanh(x)

    def softmax(self, x):
        # half types in float32; a copy either way, so the steps can run in place
        work = x.astype(np.float32) if x.dtype.itemsize < 4 else x.copy()
        return _softmax_in_place(work).astype(x.dtype, copy=False)

    def softmax_owned(self, x):
        # the core's own scores: the steps run in x, no (B, Q, K) temporaries to page in
        if x.dtype.itemsize < 4 or not x.flags.writeable:
            return self.softmax(x)
        return _softmax_in_place(x)

    def length_mask(self, x, lens, axis=-1):
        return np.arange(x.shape[axis]) < _per_row(lens)

    def where(self, mask, x, fill):
        return np.where(mask, x, np.asarray(fill, dtype=x.dtype))

    def lowest(self, x):
        return float(np.finfo(x.dtype).min)

    def host_lengths(self, x, lens):
        # numpy's lengths are host data: writing only the padding, one slice per sequence,
        # beats two masked passes at every size (medium: 0.74x instead of 1.05x the textbook)
        return lens.tolist() if lens.ndim == 1 else None

    def copy(self, x):
        return x.copy()


def _softmax_in_place(x: np.ndarray) -> np.ndarray:
    """Softmax over x's last axis, written into x (max-subtracted)."""
    x -= x.max(axis=-1, keepdims=True, initial=-np.inf)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


ops = NumpyOps()


_arrays = tensor_check("numpy")


masked_softmax, dot_product_attention, additive_attention = bind(ops)


# numpy has no autodiff: the check command and the gradient tests say so instead of testing it.
vjp = None


def from_numpy(array: Any, dtype: Optional[str] = None) -> np.ndarray:
    """A numpy copy of ``array`` (in ``dtype`` if given)."""
    return np.array(array, dtype=dtype)


def to_numpy(tensor: Any) -> np.ndarray:
    return np.asarray(tensor)


class _Layer:
    """The training flag and dropout of the numpy layers."""

    def __init__(self, dropout: float, seed: Seed) -> None:
        self.dropout = check_dropout(dropout)
        self.rng = np.random.default_rng(seed)
        self.training = True
        self.attention_weights: Optional[np.ndarray] = None

    def train(self, mode: bool = True):
        self.training = bool(mode)
        return self

    def eval(self):
        return self.train(False)

    def _dropout(self, weights: np.ndarray) -> np.ndarray:
        if not self.training or self.dropout == 0.0:
            return weights
        keep = self.rng.random(weights.shape) >= self.dropout
        return np.where(keep, weights / (1.0 - self.dropout), 0).astype(weights.dtype)


class DotProductAttention(_Layer):
    """Scaled dot-product attention; ``seed`` seeds the dropout masks."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True, *, seed: Seed = None) -> None:
        super().__init__(dropout, seed)
        self.need_weights = need_weights  # False: attention_weights is not kept

    def __call__(self, queries, keys, values, valid_lens=None) -> np.ndarray:
        _arrays(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        out, self.attention_weights = core.dot_product_attention(
            ops, queries, keys, values, valid_lens, self._dropout, self.need_weights
        )
        return out


class AdditiveAttention(CanonicalWeightsMixin, _Layer):
    """Additive attention with parameters W_q, W_k, w_v in the canonical layout.

    Initialised like ``torch.nn.Linear`` (uniform in +-1/sqrt(fan_in)) from
    ``seed``; ``dtype`` is the parameters' dtype.  The computation runs in the
    inputs' dtype, so the output dtype is the input dtype.
    """

    def __init__(
        self,
        key_size: int,
        query_size: int,
        num_hiddens: int,
        dropout: float = 0.0,
        *,
        seed: Seed = None,
        dtype: Any = "float32",
    ) -> None:
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)
        super().__init__(dropout, seed)
        self.dtype = np.dtype(dtype)

        def init(shape, fan_in):
            bound = 1.0 / np.sqrt(fan_in)
            return self.rng.uniform(-bound, bound, shape).astype(self.dtype)

        self.W_q = init((self.num_hiddens, self.query_size), self.query_size)
        self.W_k = init((self.num_hiddens, self.key_size), self.key_size)
        self.w_v = init((self.num_hiddens,), self.num_hiddens)

    def _read_weights(self) -> CanonicalWeights:
        return {"W_q": self.W_q.copy(), "W_k": self.W_k.copy(), "w_v": self.w_v.copy()}

    def _write_weights(self, weights: CanonicalWeights) -> None:
        for key, value in weights.items():
            setattr(self, key, value.astype(self.dtype))

    def __call__(self, queries, keys, values, valid_lens=None) -> np.ndarray:
        _arrays(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        dtype = queries.dtype
        out, self.attention_weights = core.additive_attention(
            ops,
            queries,
            keys,
            values,
            valid_lens,
            project_q=lambda q: q @ self.W_q.T.astype(dtype, copy=False),
            project_k=lambda k: k @ self.W_k.T.astype(dtype, copy=False),
            w_v=self.w_v.astype(dtype, copy=False),
            query_size=self.query_size,
            key_size=self.key_size,
            dropout=self._dropout,
        )
        return out
