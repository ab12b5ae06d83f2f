"""JAX layers: ``flax.nnx`` modules.

Attention weights: after an eager call or an ``nnx.jit`` call, read
``m.attention_weights`` (kept in an ``nnx.Intermediate``); under plain
``jax.jit`` (or anywhere) call ``m(..., return_weights=True)`` to get
``(output, weights)``.
"""

from __future__ import annotations

from typing import Any, Optional

from .._registry import framework_imports  # noqa: E402

with framework_imports("jax"):  # not installed: an error naming the install
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from flax.errors import TraceContextError
    from flax.nnx.nn.attention import dot_product_attention as _flax_attention

from ..backends.jax import ops, to_numpy
from . import (
    AdditiveWeights,
    AttentionCall,
    MultiHeadWeights,
    check_dropout,
    converters,
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

    _weight_field = "kernel"  # nnx.Linear's matrix, stored (in, out)

    def _parameter(self, name):
        return self._variable(name)[...]

    def _assign(self, name, value):
        variable = self._variable(name)
        variable.set_value(jnp.asarray(value.reshape(variable.shape), dtype=variable[...].dtype))

    def _dropout_now(self):
        return self.dropout if not self.dropout.deterministic and self.dropout.rate > 0 else None

    def _add_linear(self, name, in_size, out_size, bias, **options):
        setattr(self, name, nnx.Linear(in_size, out_size, use_bias=bias, **options))

    def __call__(self, queries, keys, values, valid_lens=None, *, return_weights: bool = False, **keywords):
        """The output, or (output, weights) with ``return_weights``; ``keywords``: attention_mask,
        causal, score_mod, mask_mod, block_mask (not for additive attention) and cache
        (multi-head attention only)."""
        out, weights = self._attend(
            queries, keys, values, valid_lens, self._dropout_now(), keywords, keep_weights=return_weights
        )
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


class AdditiveAttention(AdditiveWeights, _Module):
    """Additive attention with ``nnx.Linear(use_bias=False)`` maps; kernels are (in, out)."""

    _stored_in_out = True

    def __init__(
        self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0, *,
        rngs: Optional[nnx.Rngs] = None, param_dtype: Any = jnp.float32,
    ) -> None:  # fmt: skip
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        super().__init__(dropout, rngs)
        self._set_sizes(key_size, query_size, num_hiddens)
        self._build(param_dtype=param_dtype, rngs=rngs)

    def _w_v(self):
        return self.w_v.kernel[...][:, 0]


class MultiHeadAttention(MultiHeadWeights, _Module):
    """Multi-head attention (d2l 11.5) with ``nnx.Linear`` maps W_q, W_k, W_v, W_o (kernels
    (in, out), biases with ``bias=True``); heads of num_hiddens / num_heads contiguous columns.

    ``attention_weights``: (batch, num_heads, queries, keys) before dropout.
    ``num_kv_heads`` (default num_heads): grouped-query attention, W_k and W_v projecting to
    num_kv_heads heads of num_hiddens / num_heads, query head i using key/value head
    i // (num_heads / num_kv_heads).
    """

    _stored_in_out = True

    def __init__(
        self, num_hiddens: int, num_heads: int, dropout: float = 0.0, bias: bool = False, *,
        query_size: Optional[int] = None, key_size: Optional[int] = None, value_size: Optional[int] = None,
        need_weights: bool = True, num_kv_heads: Optional[int] = None, rngs: Optional[nnx.Rngs] = None,
        param_dtype: Any = jnp.float32,
    ) -> None:  # fmt: skip
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        super().__init__(dropout, rngs)
        self._set_sizes(num_hiddens, num_heads, (query_size, key_size, value_size), bias, num_kv_heads)
        self.need_weights = need_weights
        self._build(param_dtype=param_dtype, rngs=rngs)

    @classmethod
    def from_native(
        cls, layer: nnx.MultiHeadAttention, *, rngs: Optional[nnx.Rngs] = None
    ) -> "MultiHeadAttention":
        """A MultiHeadAttention with the weights, sizes, key/value heads (num_kv_heads) and dropout
        rate of a ``flax.nnx.MultiHeadAttention`` (out_features == qkv_features)."""
        if not isinstance(layer, nnx.MultiHeadAttention):
            raise TypeError(f"from_native takes a flax.nnx.MultiHeadAttention, got {type(layer).__name__}")
        arrays = converters.read(
            lambda path: converters.attribute(layer, path), converters.FLAX_PATHS, _value
        )
        config, weights = converters.flax_from(
            arrays, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, in_features=layer.in_features,
            qkv_features=layer.qkv_features, out_features=layer.out_features,
            in_kv_features=layer.in_kv_features, dropout_rate=layer.dropout_rate,
            normalize_qk=layer.normalize_qk, default_attention_fn=layer.attention_fn is _flax_attention,
        )  # fmt: skip
        out = cls(**config.kwargs(), rngs=rngs, param_dtype=layer.query.kernel[...].dtype)
        out.set_weights(weights)
        return out

    def to_native(self, *, rngs: Optional[nnx.Rngs] = None) -> nnx.MultiHeadAttention:
        """A new ``flax.nnx.MultiHeadAttention`` with these weights and num_kv_heads (needs key_size ==
        value_size; ``decode=False``, ``broadcast_dropout=False``, deterministic as this layer's dropout)."""
        kwargs, arrays = converters.flax_to(converters.config(self, self.dropout.rate), self.get_weights())
        layer = nnx.MultiHeadAttention(
            **kwargs, decode=False, deterministic=bool(self.dropout.deterministic),
            param_dtype=self.W_o.kernel[...].dtype, rngs=rngs if rngs is not None else nnx.Rngs(0),
        )  # fmt: skip
        for path, value in arrays.items():
            variable = converters.attribute(layer, path)
            variable.set_value(jnp.asarray(value, dtype=variable[...].dtype))
        return layer


def _value(variable: nnx.Variable) -> Any:
    return to_numpy(variable[...])
