"""JAX backend: the ops of jax arrays, jit/grad/vmap-friendly (layers: ``multiattn.layers.jax``).

float64 needs ``jax.config.update("jax_enable_x64", True)``; without it,
``from_numpy`` refuses float64 data instead of silently computing in float32.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from .._registry import framework_imports, layer_exports  # noqa: E402

with framework_imports("jax"):  # not installed: an error naming the install
    import jax
    import jax.numpy as jnp
    from jax.custom_derivatives import SymbolicZero

import numpy as np

from .. import fast_paths
from ..cache import KVCache
from ..functional import bind
from .numpy_like import NumpyLikeOps

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")
DTYPE_NOTES: dict = {}

_HALF = (jnp.float16, jnp.bfloat16)

try:
    from jax._src.core import is_concrete as _is_concrete
    from jax._src.core import to_concrete_value as _concrete_value
except ImportError:  # an older or newer jax: every tracer counts as unknown

    def _is_concrete(x):
        return False

    _concrete_value = None


class JaxOps(NumpyLikeOps):
    name = "jax"
    xp = jnp

    def dtype_kind(self, x):
        if jnp.issubdtype(x.dtype, jnp.floating):  # bfloat16's numpy kind is 'V'
            return "f"
        return np.dtype(x.dtype).kind

    def compiled(self, step):
        # one dispatch per block instead of one per op (inlined under an outer jit)
        return jax.jit(step)

    def split_rows(self, x, sizes):
        return jax.lax.split(x, list(sizes), axis=x.ndim - 2)  # one dispatch, not one per slice

    loop_primitives = True

    def loop(self, count, body, state):
        return jax.lax.fori_loop(0, count, body, state)

    def map_rows(self, fn, count, likes):
        return tuple(self.joined_rows(x) for x in jax.lax.map(fn, jnp.arange(count)))

    def joined_rows(self, x):
        x = jnp.moveaxis(x, 0, -3)  # one reshape, not a slice per block
        return x.reshape(x.shape[:-3] + (x.shape[-3] * x.shape[-2], x.shape[-1]))

    def row_windows(self, x, start, size, step, count):
        if step != size:
            return super().row_windows(x, start, size, step, count)
        x = x[..., start : start + count * size, :]  # tiles: one reshape, not a slice per window
        return jnp.moveaxis(x.reshape(x.shape[:-2] + (count, size, x.shape[-1])), -3, 0)

    functional_updates = True

    def write_rows(self, x, split, start, rows):
        at = (split,) + (0,) * (x.ndim - 3) + (start, 0)
        return jax.lax.dynamic_update_slice(x, rows[None], tuple(jnp.asarray(i, jnp.int32) for i in at))

    def rows_at(self, x, start, size, axis=-2):
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis % x.ndim)

    def host_values(self, x):
        if not isinstance(x, jax.core.Tracer):
            return np.asarray(x)
        # eager jax.grad's tracers hold their values; jit's and vmap's do not
        return np.asarray(_concrete_value(x)) if _is_concrete(x) else None

    def custom_gradient(self, forward, backward, tensors, constants=(), tangent=None):
        if not any(isinstance(t, jax.core.Tracer) for t in tensors):
            return forward(*tensors, *constants)  # concrete: nothing differentiates it
        n = len(tensors)
        if tangent is not None:  # jvp, hessian and grad alike (grad transposes the rule)
            linearised = jax.custom_jvp(lambda *args: tuple(forward(*args)))

            @linearised.defjvp
            def rule(primals, tangents):
                found = tuple(tangent(primals[:n], primals[n:], tangents[:n]))
                return tuple(forward(*primals)), found

            return linearised(*tensors, *constants)
        # the constants are arguments, not closed over: custom_vjp refuses closed-over tracers
        function = jax.custom_vjp(lambda *args: tuple(forward(*args)))

        def fwd(*primals):  # symbolic_zeros: each argument comes wrapped with its .value
            args = tuple(p.value for p in primals)
            outputs = tuple(forward(*args))
            return outputs, (args, outputs)

        def bwd(saved, cotangents):
            args, outputs = saved
            # an unused output's cotangent is a symbolic zero: None for backward, no work
            cotangents = tuple(None if isinstance(c, SymbolicZero) else c for c in cotangents)
            grads = backward(args[:n], args[n:], outputs, cotangents)
            return (*grads, *(None,) * (len(args) - n))  # None: the constants' zero cotangent

        function.defvjp(fwd, bwd, symbolic_zeros=True)
        return function(*tensors, *constants)

    def where(self, mask, x, fill):
        # a Python scalar is weakly typed (x's dtype): jnp.asarray(fill) would cost a dispatch
        return jnp.where(mask, x, fill)

    def softmax(self, x):
        if x.dtype in _HALF:
            return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)
        return jax.nn.softmax(x, axis=-1)

    def map_query_blocks(self, score_block, queries, step):
        # Under jit a Python loop's blocks are all alive at once in XLA; lax.map runs one
        # after another in one buffer.  Eagerly, lax.map would compile its body on every call.
        if not isinstance(queries, jax.core.Tracer):
            return super().map_query_blocks(score_block, queries, step)
        batch, n_queries, width = queries.shape
        n_blocks = -(-n_queries // step)
        # zero queries pad the last block; their scores are cut below
        padded = jnp.pad(queries, ((0, 0), (0, n_blocks * step - n_queries), (0, 0)))
        blocks = jnp.moveaxis(padded.reshape(batch, n_blocks, step, width), 1, 0)
        scores = jax.lax.map(score_block, blocks)  # (blocks, B, step, K)
        scores = jnp.moveaxis(scores, 0, 1)  # (B, blocks, step, K)
        return scores.reshape(batch, n_blocks * step, scores.shape[-1])[:, :n_queries]

    def attend_fused(self, queries, keys, values, masks, scale, dropout, need_weights):
        declined = fast_paths.declines_fused(masks, dropout, need_weights)
        if declined:
            return declined
        if not FUSED_ON_CPU and jax.default_backend() == "cpu":
            return "on the CPU XLA's kernel is slower than the core's formula"
        # the kernel needs the value width to equal the query width, and its softmax runs
        # in float32, which would cost float64 inputs their precision
        if values.shape[-1] != queries.shape[-1] or queries.dtype == jnp.float64:
            return "the value width differs from the query width, or float64"
        return functools.partial(
            fast_paths.fused_attention, self, _fused_kernel, queries, keys, values, masks, scale
        )


def _fused_kernel(queries, keys, values, mask, scale):
    # jax's layout is (batch, seq, heads, dim): heads moved there, or one head added
    heads = (lambda x: jnp.swapaxes(x, 1, 2)) if queries.ndim == 4 else (lambda x: x[:, :, None])
    out = jax.nn.dot_product_attention(
        heads(queries),
        heads(keys),
        heads(values),
        mask=None if mask is None else (mask if mask.ndim == 4 else mask[:, None]),
        scale=scale,
    )
    return jnp.swapaxes(out, 1, 2) if queries.ndim == 4 else out[:, :, 0]


# On CPU XLA's dot_product_attention is slower than the unfused math (benchmarks/RESULTS.md);
# it is the fast path on GPUs.  The tests set this to exercise the kernel on CPU too.
FUSED_ON_CPU = False

ops = JaxOps()

# a cache passes through jax.jit as its arrays and its length (a traced scalar inside)
jax.tree_util.register_pytree_node(
    KVCache, lambda c: c._flatten()[::-1], lambda fields, tensors: KVCache._unflatten(fields, tensors)
)


masked_softmax, dot_product_attention, additive_attention, multi_head_attention = bind(ops)
__getattr__ = layer_exports("jax")


def vjp(fn, args, cotangent):
    """(fn(*args), gradients of sum(fn(*args) * cotangent) with respect to args)."""
    out, pullback = jax.vjp(fn, *args)
    return out, list(pullback(cotangent))


def enable_float64() -> None:
    """Turn on jax_enable_x64 (jax computes float64 only with it); before creating arrays."""
    jax.config.update("jax_enable_x64", True)


def from_numpy(array: Any, dtype: Optional[str] = None) -> jax.Array:
    """A jax array; float64 data needs jax_enable_x64 (an error, not a silent float32)."""
    array = np.asarray(array)
    wanted = np.dtype(dtype) if dtype not in (None, "bfloat16") else array.dtype
    if wanted == np.float64 and dtype != "bfloat16" and not jax.config.jax_enable_x64:
        raise ValueError(
            "float64 needs jax_enable_x64, which is off: jax would silently compute in float32. "
            "Call jax.config.update('jax_enable_x64', True) first, or pass float32 data."
        )
    return jnp.asarray(array, dtype=dtype)


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy copy (bfloat16 comes back as float32)."""
    if tensor.dtype == jnp.bfloat16:
        tensor = tensor.astype(jnp.float32)
    return np.array(tensor)
