"""JAX backend: ``flax.nnx`` modules and jit/grad/vmap-friendly functions over the shared core.

float64 needs ``jax.config.update("jax_enable_x64", True)``; without it,
``from_numpy`` refuses float64 data instead of silently computing in float32.

Attention weights: after an eager call or an ``nnx.jit`` call, read
``m.attention_weights`` (kept in an ``nnx.Intermediate``); under plain
``jax.jit`` (or anywhere) call ``m(..., return_weights=True)`` to get
``(output, weights)``.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.errors import TraceContextError

from .. import core
from .._registry import tensor_check
from ..core import per_row as _per_row
from ..functional import bind
from ..layers import CanonicalWeights, CanonicalWeightsMixin, check_dropout, check_sizes

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")

_HALF = (jnp.float16, jnp.bfloat16)


class JaxOps:
    name = "jax"
    # XLA fuses the sum, tanh and w_v reduction of the additive features best with the
    # hiddens innermost: 10-11 ms vs 18-20 ms with keys innermost (additive size, jit)
    hiddens_innermost = True

    def shape(self, x):
        return tuple(x.shape)

    def dtype_kind(self, x):
        if jnp.issubdtype(x.dtype, jnp.floating):  # bfloat16's numpy kind is 'V'
            return "f"
        return np.dtype(x.dtype).kind

    def zeros(self, shape, like):
        return jnp.zeros(shape, dtype=like.dtype)

    def any(self, mask, axis):
        return jnp.any(mask, axis=axis, keepdims=True)

    def expand_dims(self, x, axis):
        return jnp.expand_dims(x, axis)

    def matrix_transpose(self, x):
        return jnp.swapaxes(x, -1, -2)

    def concat(self, xs, axis):
        return jnp.concatenate(xs, axis=axis)

    def matmul(self, a, b):
        return jnp.matmul(a, b)

    def matmul_t(self, a, b):
        return jnp.matmul(a, jnp.swapaxes(b, -1, -2))

    def tanh(self, x):
        return jnp.tanh(x)

    def softmax(self, x):
        if x.dtype in _HALF:
            return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)
        return jax.nn.softmax(x, axis=-1)

    def length_mask(self, x, lens, axis=-1):
        return jnp.arange(x.shape[axis]) < _per_row(lens)

    def where(self, mask, x, fill):
        return jnp.where(mask, x, jnp.asarray(fill, dtype=x.dtype))

    def lowest(self, x):
        return float(jnp.finfo(x.dtype).min)

    def map_query_blocks(self, score_block, queries, step):
        # Under jit, the blocks of a Python loop are all alive at once (XLA kept 64 MB of
        # features, as much as the textbook's whole tensor, and took 1.1x its time);
        # lax.map runs one block after another in one buffer: about 0.35x the time and a
        # tenth of the memory.  Eagerly, lax.map would compile its body on every call.
        if not isinstance(queries, jax.core.Tracer):
            return None
        batch, n_queries, width = queries.shape
        n_blocks = -(-n_queries // step)
        # zero queries pad the last block; their scores are cut below
        padded = jnp.pad(queries, ((0, 0), (0, n_blocks * step - n_queries), (0, 0)))
        blocks = jnp.moveaxis(padded.reshape(batch, n_blocks, step, width), 1, 0)
        scores = jax.lax.map(score_block, blocks)  # (blocks, B, step, K)
        scores = jnp.moveaxis(scores, 0, 1)  # (B, blocks, step, K)
        return scores.reshape(batch, n_blocks * step, scores.shape[-1])[:, :n_queries]

    def fused_attention(self, queries, keys, values, mask, scale):
        if not FUSED_ON_CPU and jax.default_backend() == "cpu":
            return None
        if values.shape[-1] != queries.shape[-1] or queries.dtype == jnp.float64:
            # jax's kernel needs the value width to equal the query width, and its
            # softmax runs in float32, which would cost float64 inputs their precision
            return None
        heads = jnp.expand_dims  # jax's layout is (batch, seq, heads, dim): one head
        out = jax.nn.dot_product_attention(
            heads(queries, 2),
            heads(keys, 2),
            heads(values, 2),
            mask=None if mask is None else heads(mask, 1),
            scale=scale,
        )[:, :, 0, :]
        return out  # the core zeroes fully masked rows, which this kernel spreads uniformly


# On CPU, XLA's dot_product_attention took 1.4-1.9x the unfused math's time in the benchmarks
# (it is the fast path on GPUs, where it can use cuDNN), so CPU runs the unfused math.
# The tests set this to exercise the kernel on CPU too.
FUSED_ON_CPU = False

ops = JaxOps()


_tensors = tensor_check("jax")


masked_softmax, dot_product_attention, additive_attention = bind(ops)


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


class _Module(nnx.Module):
    """Dropout and the attention weights of the nnx modules."""

    def __init__(self, dropout: float, rngs: Optional[nnx.Rngs]) -> None:
        self.dropout = nnx.Dropout(check_dropout(dropout), rngs=rngs)
        self._attention_weights = nnx.Intermediate(None)

    @property
    def attention_weights(self) -> Optional[jax.Array]:
        """The weights before dropout of the last call (eager or nnx.jit)."""
        return self._attention_weights.get_value()

    def _finish(self, result, return_weights: bool):
        out, weights = result
        try:
            self._attention_weights.set_value(weights)
        except TraceContextError:
            pass  # under a plain jax.jit of a closure nnx cannot update state: use return_weights
        return (out, weights) if return_weights else out


class DotProductAttention(_Module):
    """Scaled dot-product attention; dropout active in train mode (the nnx default)."""

    def __init__(
        self, dropout: float = 0.0, need_weights: bool = True, *, rngs: Optional[nnx.Rngs] = None
    ) -> None:
        super().__init__(dropout, rngs if rngs is not None else nnx.Rngs(0))
        self.need_weights = need_weights  # False: jax.nn.dot_product_attention, no weights kept

    def __call__(self, queries, keys, values, valid_lens=None, *, return_weights: bool = False):
        _tensors(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        dropping = not self.dropout.deterministic and self.dropout.rate > 0
        result = core.dot_product_attention(
            ops,
            queries,
            keys,
            values,
            valid_lens,
            self.dropout if dropping else None,
            self.need_weights or return_weights,
        )
        return self._finish(result, return_weights)


class AdditiveAttention(CanonicalWeightsMixin, _Module):
    """Additive attention with ``nnx.Linear(use_bias=False)`` maps; kernels are (in, out)."""

    def __init__(
        self,
        key_size: int,
        query_size: int,
        num_hiddens: int,
        dropout: float = 0.0,
        *,
        rngs: Optional[nnx.Rngs] = None,
        param_dtype: Any = jnp.float32,
    ) -> None:
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        super().__init__(dropout, rngs)
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)
        linear = dict(use_bias=False, param_dtype=param_dtype, rngs=rngs)
        self.W_k = nnx.Linear(self.key_size, self.num_hiddens, **linear)
        self.W_q = nnx.Linear(self.query_size, self.num_hiddens, **linear)
        self.w_v = nnx.Linear(self.num_hiddens, 1, **linear)

    def _read_weights(self) -> CanonicalWeights:
        return {
            "W_q": to_numpy(self.W_q.kernel[...]).T.copy(),
            "W_k": to_numpy(self.W_k.kernel[...]).T.copy(),
            "w_v": to_numpy(self.w_v.kernel[...]).reshape(-1),
        }

    def _write_weights(self, weights: CanonicalWeights) -> None:
        for key, value in weights.items():
            kernel = getattr(self, key).kernel
            layout = value.T if value.ndim == 2 else value[:, None]
            kernel.set_value(jnp.asarray(layout, dtype=kernel[...].dtype))

    def __call__(self, queries, keys, values, valid_lens=None, *, return_weights: bool = False):
        _tensors(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        dtype = queries.dtype
        result = core.additive_attention(
            ops,
            queries,
            keys,
            values,
            valid_lens,
            project_q=lambda q: q @ self.W_q.kernel[...].astype(dtype),
            project_k=lambda k: k @ self.W_k.kernel[...].astype(dtype),
            w_v=self.w_v.kernel[...][:, 0].astype(dtype),
            query_size=self.query_size,
            key_size=self.key_size,
            dropout=self.dropout,
        )
        return self._finish(result, return_weights)
