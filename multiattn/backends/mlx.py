"""MLX backend: the ops of mlx arrays (layers: ``multiattn.layers.mlx``).

MLX evaluates lazily: ``to_numpy`` forces evaluation.  ``mx.array`` of a
float64 numpy array silently becomes float32 unless a dtype is passed, so
``from_numpy`` always passes the array's own dtype.  MLX's exp/softmax are
float32-accurate even in float64; the README gives the tolerances.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Optional

from .._registry import framework_imports, layer_exports  # noqa: E402

with framework_imports("mlx"):  # not installed: an error naming the install
    import mlx.core as mx

import numpy as np

from .. import fast_paths
from ..functional import bind
from .numpy_like import NumpyLikeOps

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")
DTYPE_NOTES: dict = {}


_lazy = threading.local()  # depth: this thread's custom vjps running (another thread's stay eager)


class MlxOps(NumpyLikeOps):
    name = "mlx"
    xp = mx
    bool_dtype = mx.bool_

    def dtype_kind(self, x):
        dtype = x.dtype
        if dtype == mx.bool_:
            return "b"
        if mx.issubdtype(dtype, mx.complexfloating):
            return "c"
        if mx.issubdtype(dtype, mx.floating):
            return "f"
        return "u" if mx.issubdtype(dtype, mx.unsignedinteger) else "i"

    def softmax(self, x):
        return mx.softmax(x, axis=-1, precise=True)  # precise: half types accumulate in float32

    def length_mask(self, x, lens, axis=-1):
        rows = lens.shape + (1, 1) if lens.ndim == 1 else lens.shape + (1,)
        return mx.arange(x.shape[axis]) < lens.reshape(rows)  # a reshape builds faster than [:, None]

    def where(self, mask, x, fill):
        return mx.where(mask, x, fill)  # a Python float is weakly typed: x's dtype stays

    def constant(self, values, like):
        return from_numpy(values)

    def custom_gradient(self, forward, backward, tensors, constants=(), tangent=None):
        n = len(tensors)
        # a loop's blocks are computed from arrays cut from any trace (``_unrecorded``); a rule
        # with a tangent is one product, whose inputs need no evaluation first
        inputs = _unrecorded if tangent is None else (lambda x: x)
        # the constants are inputs too: a captured array would be a constant of the graph
        function = mx.custom_function(lambda *args: tuple(forward(*map(inputs, args))))

        @function.vjp
        def _(primals, cotangents, outputs):
            _lazy.depth = getattr(_lazy, "depth", 0) + 1
            try:
                grads = backward(tuple(primals[:n]), tuple(primals[n:]), tuple(outputs), tuple(cotangents))
            finally:
                _lazy.depth -= 1
            # zeros, not None: mlx would hand a None's place a wrong gradient
            return (*grads, *(mx.zeros_like(c) for c in primals[n:]))

        if tangent is not None:  # mx.jvp through it too

            @function.jvp
            def _(primals, tangents):
                given = tuple(mx.zeros_like(p) if t is None else t for p, t in zip(primals[:n], tangents))
                return tuple(tangent(tuple(primals[:n]), tuple(primals[n:]), given))

        return function(*tensors, *constants)

    def host_values(self, x):
        try:  # numpy has no bfloat16
            return np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)
        except ValueError:  # mx.compile and mx.vmap refuse the eval: values unknown there
            return None

    def unrolls_loops(self, x):
        try:  # one element: evaluated already, or cheap to
            mx.eval(x[(0,) * x.ndim])
            return False
        except ValueError:  # mx.compile and mx.vmap refuse the eval
            return True

    def settle(self, x):
        if getattr(_lazy, "depth", 0):  # inside a custom vjp an array evaluated is held to its end
            return
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
        if not FUSED_ON_CPU and mx.default_device().type == mx.cpu:
            return "on the CPU the kernel is no faster than the core's formula"  # RESULTS.md, 2026-12-06
        return functools.partial(
            fast_paths.fused_attention, self, _fused_kernel, queries, keys, values, masks, scale
        )


def _unrecorded(x):
    """x as a new array outside any transformation's trace, where it can be evaluated: under
    mx.vjp every array computed from a traced one is kept to the end, so the blocks of a
    custom function's forward would all be held at once."""
    values = ops.host_values(x)
    return x if values is None else mx.array(values).astype(x.dtype)


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


FUSED_ON_CPU = False  # the tests force it (tests/forcing.py)

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
