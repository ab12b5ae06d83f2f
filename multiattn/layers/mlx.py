"""MLX layers: ``mlx.nn.Module`` classes; ``.train()``/``.eval()``, lazy evaluation."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx import nn

from ..backends.mlx import from_numpy, ops, to_numpy
from . import (
    AttentionCall,
    CanonicalWeights,
    CanonicalWeightsMixin,
    check_dropout,
    check_sizes,
)


class DotProductAttention(AttentionCall, nn.Module):
    """Scaled dot-product attention; dropout in training mode only (``.train()``/``.eval()``)."""

    _ops, _to_numpy = ops, staticmethod(to_numpy)

    def __init__(self, dropout: float = 0.0, need_weights: bool = True) -> None:
        super().__init__()
        self._rate = check_dropout(dropout)
        self.dropout = nn.Dropout(self._rate)
        self._need_weights = need_weights  # False: mx.fast.scaled_dot_product_attention, no weights
        self._attention_weights: Optional[mx.array] = None

    @property
    def attention_weights(self) -> Optional[mx.array]:
        return self._attention_weights

    def __call__(self, queries, keys, values, valid_lens=None) -> mx.array:
        dropout = self.dropout if self.training and self._rate > 0 else None
        out, self._attention_weights = self._dot_product(
            queries, keys, values, valid_lens, dropout, self._need_weights
        )
        return out


class AdditiveAttention(CanonicalWeightsMixin, AttentionCall, nn.Module):
    """Additive attention with ``nn.Linear(bias=False)``; MLX stores weights (out, in)."""

    _stored_in_out = False

    _ops, _to_numpy = ops, staticmethod(to_numpy)

    def __init__(self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)
        self.W_k = nn.Linear(self.key_size, self.num_hiddens, bias=False)
        self.W_q = nn.Linear(self.query_size, self.num_hiddens, bias=False)
        self.w_v = nn.Linear(self.num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self._attention_weights: Optional[mx.array] = None

    @property
    def attention_weights(self) -> Optional[mx.array]:
        return self._attention_weights

    def _write_weights(self, weights: CanonicalWeights) -> None:
        for key, value in weights.items():
            linear = getattr(self, key)
            linear.weight = from_numpy(value.reshape(linear.weight.shape)).astype(linear.weight.dtype)

    def _stored_weights(self):
        return self.W_q.weight, self.W_k.weight, self.w_v.weight[0]  # W_q, W_k stored (out, in); w_v (h,)

    def __call__(self, queries, keys, values, valid_lens=None) -> mx.array:
        out, self._attention_weights = self._additive(queries, keys, values, valid_lens, self.dropout)
        return out
