"""MLX layers: ``mlx.nn.Module`` classes; ``.train()``/``.eval()``, lazy evaluation."""

from __future__ import annotations

from typing import Optional

from .._registry import framework_imports  # noqa: E402

with framework_imports("mlx"):  # not installed: an error naming the install
    import mlx.core as mx
    from mlx import nn

from ..backends.mlx import from_numpy, ops, to_numpy
from . import (
    AdditiveWeights,
    AttentionCall,
    MultiHeadWeights,
    check_dropout,
    converters,
)


class _Layer(AttentionCall, nn.Module):
    """Dropout, the attention weights and the parameters of the mlx modules (weights (out, in))."""

    _ops, _to_numpy = ops, staticmethod(to_numpy)

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self._rate = check_dropout(dropout)
        self.dropout = nn.Dropout(self._rate)
        self._attention_weights: Optional[mx.array] = None

    @property
    def attention_weights(self) -> Optional[mx.array]:
        return self._attention_weights

    def _dropout_now(self):
        return self.dropout if self.training and self._rate > 0 else None

    def _wants_weights(self) -> bool:
        return getattr(self, "_need_weights", True)

    def _parameter(self, name):
        return self._variable(name)

    def _assign(self, name, value):
        # mlx arrays are immutable: the linear map gets a new one
        linear, field = self._linear_and_field(name)
        current = getattr(linear, field)
        setattr(linear, field, from_numpy(value.reshape(current.shape)).astype(current.dtype))

    def _add_linear(self, name, in_size, out_size, bias):
        setattr(self, name, nn.Linear(in_size, out_size, bias=bias))

    def __call__(self, queries, keys, values, valid_lens=None, **keywords) -> mx.array:
        """The output; ``keywords``: attention_mask, causal, score_mod, mask_mod, block_mask
        (not for additive attention) and cache (multi-head attention only)."""
        out, self._attention_weights = self._attend(
            queries, keys, values, valid_lens, self._dropout_now(), keywords
        )
        return out


class DotProductAttention(_Layer):
    """Scaled dot-product attention; dropout in training mode only (``.train()``/``.eval()``)."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True) -> None:
        super().__init__(dropout)
        self._need_weights = need_weights  # False: mx.fast.scaled_dot_product_attention, no weights


class AdditiveAttention(AdditiveWeights, _Layer):
    """Additive attention with ``nn.Linear(bias=False)``; MLX stores weights (out, in)."""

    def __init__(self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0) -> None:
        super().__init__(dropout)
        self._set_sizes(key_size, query_size, num_hiddens)
        self._build()

    def _w_v(self):
        return self.w_v.weight[0]


class MultiHeadAttention(MultiHeadWeights, _Layer):
    """Multi-head attention (d2l 11.5) with ``nn.Linear`` maps W_q, W_k, W_v, W_o (weights
    (out, in), biases with ``bias=True``); heads of num_hiddens / num_heads contiguous columns.

    ``attention_weights``: (batch, num_heads, queries, keys) before dropout.
    ``num_kv_heads`` (default num_heads): grouped-query attention, W_k and W_v projecting to
    num_kv_heads heads of num_hiddens / num_heads, query head i using key/value head
    i // (num_heads / num_kv_heads).
    """

    def __init__(
        self, num_hiddens: int, num_heads: int, dropout: float = 0.0, bias: bool = False, *,
        query_size: Optional[int] = None, key_size: Optional[int] = None, value_size: Optional[int] = None,
        need_weights: bool = True, num_kv_heads: Optional[int] = None,
    ) -> None:  # fmt: skip
        super().__init__(dropout)
        self._set_sizes(num_hiddens, num_heads, (query_size, key_size, value_size), bias, num_kv_heads)
        self._need_weights = need_weights
        self._build()

    @classmethod
    def from_native(cls, layer: nn.MultiHeadAttention) -> "MultiHeadAttention":
        """A MultiHeadAttention with the weights, sizes and mode of an ``mlx.nn.MultiHeadAttention``
        (value_dims == value_output_dims == dims; it has no dropout)."""
        if not isinstance(layer, nn.MultiHeadAttention):
            raise TypeError(f"from_native takes an mlx.nn.MultiHeadAttention, got {type(layer).__name__}")
        arrays = converters.read(
            lambda path: converters.attribute(layer, path), converters.MLX_PATHS, to_numpy
        )
        config, weights = converters.mlx_from(arrays, num_heads=layer.num_heads)
        out = cls(**config.kwargs())
        out.set_dtype(layer.query_proj.weight.dtype)
        out.set_weights(weights)
        return out.train(layer.training)

    def to_native(self) -> nn.MultiHeadAttention:
        """A new ``mlx.nn.MultiHeadAttention`` with these weights (needs dropout == 0 and
        num_kv_heads == num_heads: it has no grouped-query attention)."""
        kwargs, arrays = converters.mlx_to(converters.config(self, self._rate), self.get_weights())
        layer = nn.MultiHeadAttention(**kwargs)
        dtype = self.W_o.weight.dtype
        for path, value in arrays.items():
            module, field = path.split(".")
            setattr(getattr(layer, module), field, from_numpy(value).astype(dtype))
        return layer.train(self.training)
