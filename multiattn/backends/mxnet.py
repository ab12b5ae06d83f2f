"""MXNet backend: the ops of MXNet's numpy interface, ``mxnet.np``/``npx`` (layers:
``multiattn.layers.mxnet``).

Loading this backend calls ``npx.set_np()`` (as d2l's mxnet code does).  MXNet's
CPU matmul has no float16, so float16 products are computed in float32 and
cast back; MXNet has no bfloat16 at all.
"""

from __future__ import annotations

from typing import Any, Optional

from .._registry import framework_imports, layer_exports  # noqa: E402

with framework_imports("mxnet"):  # not installed: an error naming the install
    import mxnet as mx
    from mxnet import autograd, np, npx

import numpy as onp

from .. import fast_paths, mods, tuning
from .._machine import measured_faster
from ..adapter import Ops
from ..functional import bind
from ..protocol import per_row

npx.set_np()

SUPPORTED_DTYPES = ("float32", "float64", "float16")
DTYPE_NOTES = {"bfloat16": "mxnet has no bfloat16 dtype"}


def _matmul(a, b):
    if a.dtype == onp.float16:  # no float16 dot on the CPU: compute in float32
        return np.matmul(a.astype("float32"), b.astype("float32")).astype("float16")
    return np.matmul(a, b)


class MxnetOps(Ops):
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
        if x.dtype == onp.bool_:  # mxnet's swapaxes has no bool kernel
            return np.swapaxes(x.astype("int8"), -1, -2).astype("bool")
        return np.swapaxes(x, -1, -2)

    def concat(self, xs, axis):
        return np.concatenate(xs, axis=axis)

    def matmul(self, a, b):
        return _matmul(a, b)

    def matmul_t(self, a, b):
        if a.ndim == b.ndim >= 3 and a.shape[:-2] == b.shape[:-2] and a.dtype != onp.float16:
            return npx.batch_dot(a, b, transpose_b=True)  # no copy of b transposed
        return _matmul(a, np.swapaxes(b, -1, -2))

    def tanh(self, x):
        return np.tanh(x)

    def tanh_by_sigmoid(self, features):
        dtype, ctx = features.dtype, features.ctx
        return measured_faster(
            (dtype, str(ctx)),
            lambda x: npx.sigmoid(x).wait_to_read(),
            lambda x: np.tanh(x).wait_to_read(),
            lambda: np.linspace(-4.0, 4.0, tuning.of(self).feature_block_elements, ctx=ctx).astype(dtype),
        )

    def sigmoid_of_sum(self, a, b, buffers):
        return npx.sigmoid(a + b)

    def softmax(self, x):
        if x.dtype == onp.float16:
            return npx.softmax(x.astype("float32"), axis=-1).astype("float16")
        return npx.softmax(x, axis=-1)

    def softmax_with_lse(self, x):
        # lse = x_0 - log w_0, or x_0 - log_softmax(x)_0 where w_0 underflows (its log-softmax
        # is a few ulp of lse less exact than log w_0)
        w, log_w = npx.softmax(x, axis=-1), npx.log_softmax(x, axis=-1)
        x_j, w_j, log_w_j = x[..., :1], w[..., :1], log_w[..., :1]
        normal = w_j > float(onp.finfo(w_j.dtype).tiny)
        return w, x_j - np.where(normal, np.log(np.where(normal, w_j, np.ones_like(w_j))), log_w_j)

    def _softmax_owned(self, x):
        # the weights take the scores' memory; not while autograd records (softmax's backward
        # needs x's graph), in float16 (float32 math), or off the CPU (tested on the CPU only)
        if x.dtype == onp.float16 or autograd.is_recording() or not _on_cpu(x):
            return self.softmax(x)
        return npx.softmax(x, axis=-1, out=x)

    def length_mask(self, x, lens, axis=-1):
        # mxnet's arange is float32 by default: compare in float64 to keep integer lengths exact
        positions = np.arange(x.shape[axis], dtype="float64")
        return positions < per_row(lens.astype("float64"))

    def causal_mask(self, n_queries, n_keys, like):
        return np.arange(n_keys, ctx=like.ctx)[None, :] <= np.arange(n_queries, ctx=like.ctx)[:, None]

    def logical_and(self, a, b):
        return (a.astype("int8") * b.astype("int8")) > 0  # mxnet.np has no logical_and on bool

    def split_heads(self, x, num_heads):
        batch, n, width = x.shape
        return np.transpose(x.reshape(batch, n, num_heads, width // num_heads), (0, 2, 1, 3))

    def merge_heads(self, x):
        batch, heads, n, width = x.shape
        return np.transpose(x, (0, 2, 1, 3)).reshape(batch, n, heads * width)

    def reshape(self, x, shape):
        return x.reshape(tuple(shape))

    def where(self, mask, x, fill):
        if autograd.is_recording() or not _on_cpu(x):
            return np.where(mask, x, np.array(fill, dtype=x.dtype))
        # the legacy where over full-shape operands: np.where's broadcasting is several times
        # slower (benchmarks/RESULTS.md); not recorded by autograd, so only outside it
        condition = np.broadcast_to(mask, x.shape).astype(x.dtype).as_nd_ndarray()
        filled = mx.nd.full(x.shape, fill, dtype=x.dtype, ctx=x.ctx)
        return mx.nd.where(condition, x.as_nd_ndarray(), filled).as_np_ndarray()

    def select(self, condition, x, y):
        x = x if isinstance(x, np.ndarray) else np.array(x, dtype=y.dtype, ctx=y.ctx)
        return np.where(
            condition, x, y if isinstance(y, np.ndarray) else np.array(y, dtype=x.dtype, ctx=x.ctx)
        )

    def call_mod(self, fn, args, like):
        # int64 * 0.1 gives integers; mxnet indexes with floats, exact as integers in float32
        dtype = self.widen(like).dtype
        return mods.call_with_positions_as(fn, args, lambda x: x.astype(dtype))

    def positions(self, start, stop, like):
        return np.arange(start, stop, dtype="int64", ctx=like.ctx)

    def constant(self, values, like):
        return np.array(values, dtype=values.dtype, ctx=like.ctx)

    def lowest(self, x):
        return float(onp.finfo(x.dtype).min)

    def cast(self, x, like):
        return x if x.dtype == like.dtype else x.astype(like.dtype)

    def widen(self, x):
        return x.astype("float32") if x.dtype == onp.float16 else x

    def exp(self, x):
        return np.exp(x)

    def log(self, x):
        return np.log(x)

    def max(self, x, axis):
        return np.max(x, axis=axis, keepdims=True)

    def sum(self, x, axis):
        if axis == -1 and 1 < x.ndim < 6 and x.dtype in (onp.float32, onp.float64):
            # its sum along an axis is slower than a product with ones (benchmarks/RESULTS.md, long
            # sequences); its batched product of 6-D operands fails a shape check (BatchGEMM)
            return np.matmul(x, np.ones((x.shape[-1], 1), dtype=x.dtype, ctx=x.ctx))
        return np.sum(x, axis=axis, keepdims=True)

    def maximum(self, a, b):
        return np.maximum(a, b)

    def host_values(self, x):
        return x.asnumpy()

    def settle(self, x):
        # the engine runs ops asynchronously: unwaited, a loop of blocks queues them all at once
        for tensor in x if isinstance(x, tuple) else (x,):
            getattr(tensor, "wait_to_read", lambda: None)()  # symbols (hybridized) have none

    def custom_gradient(self, forward, backward, tensors, constants=(), tangent=None):
        if not autograd.is_recording():
            return forward(*tensors, *constants)
        return _CustomGradient(forward, backward, constants)(*map(_anchored, tensors))

    # -- specialisations --------------------------------------------------------------------

    # mxnet's `where` is slow next to its sequence mask (a select, so NaN in the padding stays
    # out): the padding is written by the sequence mask, on views (mxnet.numpy's reshape
    # copies) and into the core's own scores (out=) outside autograd.
    def masked_softmax_writing_padding(self, scores, values, masks, owned):
        if not masks.only_lengths:
            return "not lengths alone"
        if scores.dtype == onp.float64:  # sequence_mask's fill is float32: float64's lowest does not fit
            return "float64 (the sequence mask's fill is float32)"
        lengths = masks.valid_lens.asnumpy().astype("float64").tolist()
        return fast_paths.offer_writing_padding(
            self, scores, values, owned, lengths, copy=lambda x: x.copy(), softmax=self._softmax_owned,
            fill=self._fill_padding, zero_rows=self._zero_padded_rows,
        )  # fmt: skip

    def masked_softmax_in_scores_memory(self, scores, values, masks, owned):
        return fast_paths.offer_in_scores_memory(
            self, scores, values, masks, owned, where=self.where, softmax=self._softmax_owned
        )

    def _fill_padding(self, x, lengths, fill, uniform=False):
        n_keys = x.shape[-1]
        rows = _row_lengths(onp.asarray(lengths, dtype="int64"), x.shape)
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
        _sequence_mask(flat, rows, fill, out=flat)
        return x

    def _zero_padded_rows(self, values, lengths):
        if onp.isfinite(float(values.sum())):  # 0 * x is 0: nothing to zero
            return values
        lengths = onp.asarray(lengths, dtype="int64")
        if lengths.ndim == 2:  # per-query lengths: a key is used if any query may see it
            lengths = lengths.max(axis=1)
        n_keys = values.shape[-2]
        if (lengths >= n_keys).all():
            return values
        # (B, [H,] K, v) as (B * H, K, v), each sequence's length once per head
        groups = values.size // (values.shape[0] * n_keys * values.shape[-1])
        flat = values.reshape(-1, n_keys, values.shape[-1])
        return _sequence_mask(flat, onp.repeat(lengths, groups), 0.0).reshape(values.shape)


class _CustomGradient(autograd.Function):
    """``Ops.custom_gradient``: forward saves its inputs and outputs, backward is the core's;
    the constants are held, not inputs (mxnet's Function wants a gradient for every input)."""

    def __init__(self, forward, backward, constants):
        super().__init__()
        self._forward, self._backward, self._constants = forward, backward, constants

    def forward(self, *tensors):
        outputs = self._forward(*tensors, *self._constants)
        self.save_for_backward(tensors, outputs)
        return outputs

    def backward(self, *cotangents):
        tensors, outputs = self.saved_tensors
        # Function hands over and takes back legacy NDArrays, not mxnet.np arrays
        cotangents = tuple(c.as_np_ndarray() for c in cotangents)
        grads = self._backward(tensors, self._constants, outputs, cotangents)
        return tuple(g.as_nd_ndarray() for g in grads)


def _anchored(x):
    """x through one recorded op from an attached zero, so its gradient is always written:
    mxnet 1.9's Function skips every input after one that needs none, and ignores grad_req='add'."""
    anchor = np.zeros((), dtype=x.dtype, ctx=x.ctx)
    anchor.attach_grad()
    return x + anchor


def _on_cpu(x) -> bool:
    return x.ctx.device_type == "cpu"


def _row_lengths(lengths: onp.ndarray, shape: tuple) -> onp.ndarray:
    """The length of every row of scores (B, [H,] Q, K) flattened to (-1, K): lengths (B,) or
    (B, Q), shared by the heads."""
    n_queries = shape[-2]
    heads = shape[1] if len(shape) == 4 else 1
    per_query = lengths if lengths.ndim == 2 else onp.repeat(lengths[:, None], n_queries, 1)
    return onp.repeat(per_query[:, None, :], heads, 1).reshape(-1)


def _last_column(x) -> onp.ndarray:
    """x[..., -1] in host memory: mxnet's slice has a high fixed cost, so small x are read whole."""
    return x.asnumpy()[..., -1] if x.size <= _SMALL_ELEMENTS else x[..., -1].asnumpy()


_SMALL_ELEMENTS = 1 << 16


def _view(x, shape):
    """x reshaped without a copy: mxnet.numpy's reshape copies, the legacy NDArray's is a
    view of the same memory."""
    return x.as_nd_ndarray().reshape(shape).as_np_ndarray()


def _sequence_mask(x, lengths: onp.ndarray, fill: float, out=None):
    """x with the positions >= lengths (one per row of axis 0) of axis 1 set to fill
    (written into out where given, which may be x itself)."""
    fill = max(fill, -1e38)  # its value passes through float32 text: float32's lowest comes back -inf
    return npx.sequence_mask(
        x, _device_lengths(lengths), use_sequence_length=True, value=fill, axis=1, out=out
    )


_DEVICE_LENGTHS: dict = {}


def _device_lengths(lengths: onp.ndarray):
    """lengths as an mxnet int32 array, the last few kept: making one costs about as much as
    the sequence mask itself, and a call masks the scores, the weights and the values."""
    key = (lengths.astype("int32").tobytes(), str(npx.current_context()))
    array = _DEVICE_LENGTHS.get(key)
    if array is None:
        if len(_DEVICE_LENGTHS) >= 8:
            _DEVICE_LENGTHS.clear()
        array = _DEVICE_LENGTHS[key] = np.array(lengths, dtype="int32")
    return array


ops = MxnetOps()
masked_softmax, dot_product_attention, additive_attention, multi_head_attention = bind(ops)
__getattr__ = layer_exports("mxnet")


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
