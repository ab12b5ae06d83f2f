"""Array API backend: any library that follows the Python Array API standard (array-api-strict,
CuPy, Dask, ndonnx, ...), through ``array-api-compat``.  Functions only, no layer classes.

Each call finds the namespace of its tensors (``array_namespace``).  ``from_numpy`` makes
arrays of ``namespace`` (array-api-strict unless ``use_namespace`` says otherwise).  The
standard has no float16/bfloat16 and no autodiff.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._registry import framework_imports  # noqa: E402

with framework_imports("array_api"):  # not installed: an error naming the install
    from array_api_compat import array_namespace, device

from .. import mods, sharding
from ..adapter import Ops
from ..functional import bind

SUPPORTED_DTYPES = ("float32", "float64")
DTYPE_NOTES = {dtype: "the Array API standard has no " + dtype for dtype in ("float16", "bfloat16")}
_KINDS = (("bool", "b"), ("real floating", "f"), ("signed integer", "i"), ("unsigned integer", "u"))


class ArrayApiOps(Ops):
    name = "array_api"

    def shape(self, x):
        return tuple(x.shape)

    def dtype_kind(self, x):
        xp = array_namespace(x)
        return next((kind for kinds, kind in _KINDS if xp.isdtype(x.dtype, kinds)), "c")

    def zeros(self, shape, like):
        return array_namespace(like).zeros(shape, dtype=like.dtype, device=device(like))

    def any(self, mask, axis):
        return array_namespace(mask).any(mask, axis=axis, keepdims=True)

    def expand_dims(self, x, axis):
        return array_namespace(x).expand_dims(x, axis=axis)

    def matrix_transpose(self, x):
        return array_namespace(x).matrix_transpose(x)

    def concat(self, xs, axis):
        return array_namespace(*xs).concat(xs, axis=axis)

    def matmul(self, a, b):
        return array_namespace(a, b).matmul(a, b)

    def matmul_t(self, a, b):
        xp = array_namespace(a, b)
        return xp.matmul(a, xp.matrix_transpose(b))

    def tanh(self, x):
        return array_namespace(x).tanh(x)

    def softmax(self, x):
        xp = array_namespace(x)
        e = xp.exp(x - xp.max(x, axis=-1, keepdims=True))
        return e / xp.sum(e, axis=-1, keepdims=True)

    def length_mask(self, x, lens, axis=-1):
        xp = array_namespace(x, lens)
        # the standard does not promote integers against floats: compare in lens' kind
        dtype = lens.dtype if xp.isdtype(lens.dtype, "real floating") else xp.int64
        positions = xp.arange(x.shape[axis], dtype=dtype, device=device(x))
        lens = xp.astype(lens, dtype)
        per_row = xp.reshape(lens, (lens.shape[0], -1, 1))  # (B, 1|Q, 1)
        return positions < per_row

    def causal_mask(self, n_queries, n_keys, like):
        xp = array_namespace(like)
        positions = lambda n: xp.arange(n, device=device(like))  # noqa: E731
        return positions(n_keys)[None, :] <= positions(n_queries)[:, None]

    def logical_and(self, a, b):
        return array_namespace(a, b).logical_and(a, b)

    def split_heads(self, x, num_heads):
        xp = array_namespace(x)
        batch, n, width = x.shape
        return xp.permute_dims(xp.reshape(x, (batch, n, num_heads, width // num_heads)), (0, 2, 1, 3))

    def merge_heads(self, x):
        xp = array_namespace(x)
        batch, heads, n, width = x.shape
        return xp.reshape(xp.permute_dims(x, (0, 2, 1, 3)), (batch, n, heads * width))

    def reshape(self, x, shape):
        return array_namespace(x).reshape(x, tuple(shape))

    def where(self, mask, x, fill):
        xp = array_namespace(x)
        return xp.where(mask, x, xp.asarray(fill, dtype=x.dtype, device=device(x)))

    def select(self, condition, x, y):
        xp = array_namespace(*(t for t in (condition, x, y) if hasattr(t, "shape")))
        x = x if hasattr(x, "shape") else xp.asarray(x, dtype=y.dtype, device=device(y))
        return xp.where(
            condition, x, y if hasattr(y, "shape") else xp.asarray(y, dtype=x.dtype, device=device(x))
        )

    def take(self, x, indices):
        xp = array_namespace(x)
        return xp.reshape(xp.take(x, xp.reshape(indices, (-1,))), indices.shape)

    def call_mod(self, fn, args, like):
        # the standard leaves int * float undefined; array-api-strict refuses it
        return mods.call_with_index(self, fn, args, like)

    def positions(self, start, stop, like):
        return array_namespace(like).arange(start, stop, device=device(like))

    def constant(self, values, like):
        xp = array_namespace(like)
        return xp.asarray(values, dtype=getattr(xp, str(values.dtype)), device=device(like))

    def lowest(self, x):
        return float(array_namespace(x).finfo(x.dtype).min)

    def cast(self, x, like):
        return array_namespace(x).astype(x, like.dtype)

    def widen(self, x):
        xp = array_namespace(x)
        return xp.astype(x, xp.float32) if xp.finfo(x.dtype).bits < 32 else x

    def exp(self, x):
        return array_namespace(x).exp(x)

    def log(self, x):
        return array_namespace(x).log(x)

    def max(self, x, axis):
        return array_namespace(x).max(x, axis=axis, keepdims=True)

    def sum(self, x, axis):
        return array_namespace(x).sum(x, axis=axis, keepdims=True)

    def maximum(self, a, b):
        xp = array_namespace(a)
        if isinstance(b, float):
            b = xp.asarray(b, dtype=a.dtype, device=device(a))
        return xp.maximum(a, b)

    def attend_over_chunks(self, queries, keys, values, masks, scale, score_mod, block_size):
        return sharding.offer(queries, keys, values, masks, scale, score_mod, block_size)

    def host_values(self, x):
        try:  # through DLPack: host arrays only
            return to_numpy(x)
        except (AttributeError, BufferError, RuntimeError, TypeError, ValueError):  # lazy (dask): none
            return None


ops = ArrayApiOps()
masked_softmax, dot_product_attention, additive_attention, multi_head_attention = bind(ops)
vjp = None  # the standard has no autodiff

try:  # the library from_numpy makes arrays of: the standard's reference namespace by default
    import array_api_strict as namespace
except ImportError:  # pragma: no cover - any other Array API library, via use_namespace
    namespace = None


def use_namespace(xp: Any) -> None:
    """Make ``from_numpy`` build arrays of ``xp`` (an Array API namespace)."""
    global namespace
    namespace = xp


def from_numpy(array: Any, dtype: Optional[str] = None) -> Any:
    """A new array of ``namespace`` with the values of ``array``."""
    if namespace is None:
        raise ImportError(
            "from_numpy needs array-api-strict (pip install array-api-strict) or use_namespace(xp)"
        )
    array = np.array(array, dtype=dtype)
    return namespace.asarray(array, dtype=getattr(namespace, str(array.dtype)))


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy copy, through DLPack (the standard's way out)."""
    return np.array(np.from_dlpack(tensor))
