"""PaddlePaddle layers: ``paddle.nn.Layer`` classes (import paddle before tensorflow)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .._registry import framework_imports  # noqa: E402

with framework_imports("paddle"):  # not installed: an error naming the install
    import paddle  # noqa: E402
    from paddle import nn  # noqa: E402

from .. import (
    _registry,
    core,
    fast_paths,
    functional,
    layers,
    masks,
    protocol,
    specialisations,
    specialise,
    validation,
)
from ..backends.paddle import ops, to_numpy  # first: it guards the paddle import
from . import (
    AdditiveWeights,
    AttentionCall,
    MultiHeadWeights,
    check_dropout,
    converters,
)

# paddle.jit.to_static would transcribe every function a layer calls, the framework-free
# modules included, and trips on their plain Python; those modules run as Python instead.
paddle.jit.ignore_module(
    [
        _registry,
        converters,
        core,
        fast_paths,
        functional,
        layers,
        masks,
        protocol,
        specialise,
        specialisations,
        validation,
    ]
)


class _Layer(AttentionCall, nn.Layer):
    """The ops and the parameters of the paddle layers (Linear weights stored (in, out))."""

    _ops, _to_numpy = ops, staticmethod(to_numpy)
    _stored_in_out = True

    def _parameter(self, name):
        return self._variable(name)

    def _assign(self, name, value):
        param = self._parameter(name)
        param.set_value(
            paddle.to_tensor(np.ascontiguousarray(value.reshape(param.shape))).astype(param.dtype)
        )

    def _add_linear(self, name, in_size, out_size, bias):
        setattr(self, name, nn.Linear(in_size, out_size, bias_attr=None if bias else False))

    def _add_dropout(self, dropout: float) -> None:
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.attention_weights: Optional[paddle.Tensor] = None

    def forward(self, queries, keys, values, valid_lens=None, **keywords):
        """The output; ``keywords``: attention_mask, causal, score_mod, mask_mod, block_mask
        (not for additive attention) and cache (multi-head attention only)."""
        out, self.attention_weights = self._attend(queries, keys, values, valid_lens, self.dropout, keywords)
        return out


class DotProductAttention(_Layer):
    """Scaled dot-product attention; dropout in train mode only (``.train()``/``.eval()``)."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True) -> None:
        super().__init__()
        self._add_dropout(dropout)
        self.need_weights = need_weights  # False: attention_weights is not kept


class AdditiveAttention(AdditiveWeights, _Layer):
    """Additive attention with ``nn.Linear(bias_attr=False)``; paddle stores weights (in, out)."""

    def __init__(self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0) -> None:
        super().__init__()
        self._set_sizes(key_size, query_size, num_hiddens)
        self._build()
        self._add_dropout(dropout)

    def _w_v(self):
        return self.w_v.weight[:, 0]


class MultiHeadAttention(MultiHeadWeights, _Layer):
    """Multi-head attention (d2l 11.5) with ``nn.Linear`` maps W_q, W_k, W_v, W_o (weights
    stored (in, out), biases with ``bias=True``); heads of num_hiddens / num_heads columns.

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
        super().__init__()
        self._set_sizes(num_hiddens, num_heads, (query_size, key_size, value_size), bias, num_kv_heads)
        self.need_weights = need_weights
        self._build()
        self._add_dropout(dropout)

    @classmethod
    def from_native(cls, layer: nn.MultiHeadAttention) -> "MultiHeadAttention":
        """A MultiHeadAttention with the weights, sizes, dropout and mode of a
        ``paddle.nn.MultiHeadAttention``."""
        if not isinstance(layer, nn.MultiHeadAttention):
            raise TypeError(f"from_native takes a paddle.nn.MultiHeadAttention, got {type(layer).__name__}")
        arrays = converters.read(
            lambda path: converters.attribute(layer, path), converters.PADDLE_PATHS, to_numpy
        )
        config, weights = converters.paddle_from(
            arrays, embed_dim=layer.embed_dim, num_heads=layer.num_heads, kdim=layer.kdim, vdim=layer.vdim,
            dropout=layer.dropout,
        )  # fmt: skip
        out = cls(**config.kwargs())
        out.to(dtype=layer.q_proj.weight.dtype)
        out.set_weights(weights)
        out.train(layer.training)
        return out

    def to_native(self) -> nn.MultiHeadAttention:
        """A new ``paddle.nn.MultiHeadAttention`` with these weights (needs query_size == num_hiddens
        and num_kv_heads == num_heads: it has no grouped-query attention)."""
        kwargs, arrays = converters.paddle_to(converters.config(self, self.dropout.p), self.get_weights())
        layer = nn.MultiHeadAttention(**kwargs)
        layer.to(dtype=self.W_o.weight.dtype)
        for path, value in arrays.items():
            param = converters.attribute(layer, path)
            param.set_value(paddle.to_tensor(value).astype(param.dtype))
        layer.train(self.training)
        return layer
