"""MXNet backend: Gluon blocks on MXNet's numpy interface (``mxnet.np``/``npx``).

Loading this backend calls ``npx.set_np()`` (as d2l's mxnet code does): the
numpy-compatible arrays are what the layers take and return.  Dropout is
active only inside ``autograd.record()`` (MXNet's training mode).  MXNet's
CPU matmul has no float16, so float16 products are computed in float32 and
cast back; MXNet has no bfloat16 at all.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as onp
from mxnet import autograd, np, npx
from mxnet.gluon import nn

from .. import core
from .._registry import tensor_check
from ..core import per_row as _per_row
from ..functional import bind
from ..layers import CanonicalWeights, CanonicalWeightsMixin, check_dropout, check_sizes

npx.set_np()

SUPPORTED_DTYPES = ("float32", "float64", "float16")
DTYPE_NOTES = {"bfloat16": "mxnet has no bfloat16 dtype"}


def _matmul(a, b):
    if a.dtype == onp.float16:  # no float16 dot on the CPU: compute in float32
        return np.matmul(a.astype("float32"), b.astype("float32")).astype("float16")
    return np.matmul(a, b)


class MxnetOps:
    name = "mxnet"

    def shape(self, x):
        return tuple(x.shape)

    def dtype_kind(self, x):
        return onp.dtype(x.dtype).kind

    def zeros(self, shape, like):
        return np.zeros(shape, dtype=like.dtype)

    def any(self, mask, axis):
        return mask.astype("int32").max(axis=axis, keepdims=True) > 0  # mxnet.np has no any()

    def expand_dims(self, x, axis):
        return np.expand_dims(x, axis)

    def matrix_transpose(self, x):
        return np.swapaxes(x, -1, -2)

    def concat(self, xs, axis):
        return np.concatenate(xs, axis=axis)

    def matmul(self, a, b):
        return _matmul(a, b)

    def matmul_t(self, a, b):
        return _matmul(a, np.swapaxes(b, -1, -2))

    def tanh(self, x):
        return np.tanh(x)

    def softmax(self, x):
        if x.dtype == onp.float16:
            return npx.softmax(x.astype("float32"), axis=-1).astype("float16")
        return npx.softmax(x, axis=-1)

    def softmax_owned(self, x):
        # the weights take the scores' memory: 2.0 vs 2.5 ms at (8, 512, 512).  Not while
        # autograd records (softmax's backward needs x's graph), in float16 (float32 math),
        # or off the CPU (writing into the input is tested on the CPU only).
        if x.dtype == onp.float16 or autograd.is_recording() or not _on_cpu(x):
            return self.softmax(x)
        return npx.softmax(x, axis=-1, out=x)

    def length_mask(self, x, lens, axis=-1):
        # mxnet's arange is float32 by default: compare in float64 to keep integer lengths exact
        positions = np.arange(x.shape[axis], dtype="float64")
        return positions < _per_row(lens.astype("float64"))

    def where(self, mask, x, fill):
        return np.where(mask, x, np.array(fill, dtype=x.dtype))

    def lowest(self, x):
        return float(onp.finfo(x.dtype).min)

    # mxnet's `where` costs 30 ms at (8, 512, 512), its sequence mask (a select, so NaN in
    # the padding stays out) 19 ms, and the exactness check below is a (B, Q) read: the
    # masked softmax takes one sequence mask instead of two wheres (medium: 1.5x -> 0.6-0.7x
    # the textbook).  Outside autograd, the masks run on views (mxnet.numpy's reshape
    # copies) and into the core's own x (out=, an elementwise select): no (B, Q, K) copy
    # at all (long: 1.35x -> 0.44x the textbook's peak memory, 0.59x -> 0.42x its time);
    # the caller's x gets one new array.
    def fill_padding(self, x, lens, fill, uniform=False, owned=False):
        if abs(fill) > _FLOAT32_MAX:  # sequence_mask's fill is a float32 parameter: float64's
            return None  # lowest does not fit, so float64 keeps the masked where
        batch, n_queries, n_keys = x.shape
        lengths = _host_lengths(lens, n_keys)
        rows = lengths.reshape(-1) if lengths.ndim == 2 else onp.repeat(lengths, n_queries)
        padded = rows < n_keys
        if not padded.any():
            return x
        if uniform and (rows[padded] > 0).all():
            # one value per row: the last column (padding wherever there is any) tells
            last = _last_column(x).reshape(-1)
            if (last[padded] == fill).all():
                return x
        # a copy while autograd records (views and out= would cut its graph) and off the CPU
        # (writing through a view is tested on the CPU only)
        if autograd.is_recording() or not _on_cpu(x):
            return _sequence_mask(x.reshape(-1, n_keys), rows, fill).reshape(x.shape)
        flat = _view(x, (-1, n_keys))
        if owned:
            _sequence_mask(flat, rows, fill, out=flat)
            return x
        return _view(_sequence_mask(flat, rows, fill), x.shape)

    def zero_padded_rows(self, values, lens):
        lengths = _host_lengths(lens, values.shape[1])
        if lengths.ndim == 2:  # per-query lengths: a key is used if any query may see it
            lengths = lengths.max(axis=1)
        return values if (lengths >= values.shape[1]).all() else _sequence_mask(values, lengths, 0.0)


_FLOAT32_MAX = float(onp.finfo("float32").max)


def _host_lengths(lens, n_keys: int) -> onp.ndarray:
    """The lengths as sequence_mask must get them: it truncates, but position p is visible
    for p < length, so ceil (2.5 shows positions 0-2); clipped to [0, n_keys], NaN to 0
    (the mask's comparison with NaN is false: nothing visible).  The rule of the core's
    ``_host_lengths``, vectorised: per-query lengths give B * Q of them."""
    lengths = onp.nan_to_num(lens.asnumpy().astype("float64"), nan=0.0)
    return onp.clip(onp.ceil(lengths), 0, n_keys)


def _on_cpu(x) -> bool:
    return x.ctx.device_type == "cpu"


def _last_column(x) -> onp.ndarray:
    """x[:, :, -1] in host memory.  mxnet's slice costs about 0.25 ms whatever the size and
    reading a small x whole 0.02 ms; large x are sliced first."""
    return x.asnumpy()[:, :, -1] if x.size <= _SMALL_ELEMENTS else x[:, :, -1].asnumpy()


_SMALL_ELEMENTS = 1 << 16


def _view(x, shape):
    """x reshaped without a copy: mxnet.numpy's reshape copies, the legacy NDArray's is a
    view of the same memory."""
    return x.as_nd_ndarray().reshape(shape).as_np_ndarray()


def _sequence_mask(x, lengths: onp.ndarray, fill: float, out=None):
    """x with the positions >= lengths (one per row of axis 0) of axis 1 set to fill
    (written into out where given, which may be x itself)."""
    lengths = np.array(lengths, dtype="int32")
    return npx.sequence_mask(x, lengths, use_sequence_length=True, value=fill, axis=1, out=out)


ops = MxnetOps()


_tensors = tensor_check("mxnet")


masked_softmax, dot_product_attention, additive_attention = bind(ops)


def vjp(fn, args, cotangent):
    """(fn(*args), gradients of sum(fn(*args) * cotangent) with respect to args).

    Recorded with train_mode=False, so no layer inside fn applies dropout."""
    args = [a.copy() for a in args]
    for a in args:
        a.attach_grad()
    with autograd.record(train_mode=False):
        out = fn(*args)
    out.backward(cotangent)
    return out, [a.grad for a in args]


def from_numpy(array: Any, dtype: Optional[str] = None) -> np.ndarray:
    array = onp.array(array)
    return np.array(array, dtype=dtype or array.dtype)


def to_numpy(tensor: Any) -> onp.ndarray:
    return onp.array(tensor.asnumpy())


class DotProductAttention(nn.Block):
    """Scaled dot-product attention; dropout only inside ``autograd.record()``."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.need_weights = need_weights  # False: attention_weights is not kept
        self.attention_weights = None

    def forward(self, queries, keys, values, valid_lens=None):
        _tensors(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        out, self.attention_weights = core.dot_product_attention(
            ops, queries, keys, values, valid_lens, self.dropout, self.need_weights
        )
        return out


class AdditiveAttention(CanonicalWeightsMixin, nn.Block):
    """Additive attention with ``nn.Dense(use_bias=False, flatten=False)``; weights (out, in).

    The parameters are initialised at construction (the sizes are known), so
    there is no ``initialize()`` to call; calling it anyway only warns.
    """

    def __init__(
        self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)
        dense = dict(use_bias=False, flatten=False)
        self.W_k = nn.Dense(self.num_hiddens, in_units=self.key_size, **dense)
        self.W_q = nn.Dense(self.num_hiddens, in_units=self.query_size, **dense)
        self.w_v = nn.Dense(1, in_units=self.num_hiddens, **dense)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.attention_weights = None
        self.initialize()

    def _read_weights(self) -> CanonicalWeights:
        return {
            "W_q": to_numpy(self.W_q.weight.data()),
            "W_k": to_numpy(self.W_k.weight.data()),
            "w_v": to_numpy(self.w_v.weight.data()).reshape(-1),
        }

    def _write_weights(self, weights: CanonicalWeights) -> None:
        for key, value in weights.items():
            param = getattr(self, key).weight
            param.set_data(np.array(value.reshape(param.shape), dtype=param.dtype))

    def forward(self, queries, keys, values, valid_lens=None):
        _tensors(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        dtype = queries.dtype
        out, self.attention_weights = core.additive_attention(
            ops,
            queries,
            keys,
            values,
            valid_lens,
            project_q=lambda q: ops.matmul_t(q, self.W_q.weight.data().astype(dtype)),
            project_k=lambda k: ops.matmul_t(k, self.W_k.weight.data().astype(dtype)),
            w_v=self.w_v.weight.data()[0].astype(dtype),
            query_size=self.query_size,
            key_size=self.key_size,
            dropout=self.dropout,
        )
        return out
