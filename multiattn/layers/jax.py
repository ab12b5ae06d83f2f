"""JAX layers: ``flax.nnx`` modules.

Attention weights: after an eager call or an ``nnx.jit`` call, read
``m.attention_weights`` (kept in an ``nnx.Intermediate``); under plain
``jax.jit`` (or anywhere) call ``m(..., return_weights=True)`` to get
``(output, weights)``.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from flax.errors import TraceContextError

from ..backends.jax import ops, to_numpy
from . import (
    AttentionCall,
    CanonicalWeights,
    CanonicalWeightsMixin,
    check_dropout,
    check_sizes,
)


class _Module(AttentionCall, nnx.Module):
    """Dropout and the attention weights of the nnx modules."""

    _ops, _to_numpy = ops, staticmethod(to_numpy)

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
        dropping = not self.dropout.deterministic and self.dropout.rate > 0
        dropout = self.dropout if dropping else None
        result = self._dot_product(
            queries, keys, values, valid_lens, dropout, self.need_weights or return_weights
        )
        return self._finish(result, return_weights)


class AdditiveAttention(CanonicalWeightsMixin, _Module):
    """Additive attention with ``nnx.Linear(use_bias=False)`` maps; kernels are (in, out)."""

    _stored_in_out = True

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

    def _write_weights(self, weights: CanonicalWeights) -> None:
        for key, value in weights.items():
            kernel = getattr(self, key).kernel
            layout = value.T if value.ndim == 2 else value[:, None]
            kernel.set_value(jnp.asarray(layout, dtype=kernel[...].dtype))

    def _stored_weights(self):
        return (
            self.W_q.kernel[...],
            self.W_k.kernel[...],
            self.w_v.kernel[...][:, 0],
        )  # W_q, W_k stored (in, out); w_v (h,)

    def __call__(self, queries, keys, values, valid_lens=None, *, return_weights: bool = False):
        result = self._additive(queries, keys, values, valid_lens, self.dropout)
        return self._finish(result, return_weights)
