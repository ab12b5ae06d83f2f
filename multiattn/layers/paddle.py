"""PaddlePaddle layers: ``paddle.nn.Layer`` classes (import paddle before tensorflow)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import paddle  # noqa: E402
from paddle import nn  # noqa: E402

from ..backends.paddle import ops, to_numpy  # first: it guards the paddle import
from . import (
    AttentionCall,
    CanonicalWeights,
    CanonicalWeightsMixin,
    canonical_from_stored,
    check_dropout,
    check_sizes,
)


class DotProductAttention(AttentionCall, nn.Layer):
    """Scaled dot-product attention; dropout in train mode only (``.train()``/``.eval()``)."""

    _ops = ops

    def __init__(self, dropout: float = 0.0, need_weights: bool = True) -> None:
        super().__init__()
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.need_weights = need_weights  # False: attention_weights is not kept
        self.attention_weights: Optional[paddle.Tensor] = None

    def forward(self, queries, keys, values, valid_lens=None) -> paddle.Tensor:
        out, self.attention_weights = self._dot_product(
            queries, keys, values, valid_lens, self.dropout, self.need_weights
        )
        return out


class AdditiveAttention(CanonicalWeightsMixin, AttentionCall, nn.Layer):
    """Additive attention with ``nn.Linear(bias_attr=False)``; paddle stores weights (in, out)."""

    _ops = ops

    def __init__(self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)
        self.W_k = nn.Linear(self.key_size, self.num_hiddens, bias_attr=False)
        self.W_q = nn.Linear(self.query_size, self.num_hiddens, bias_attr=False)
        self.w_v = nn.Linear(self.num_hiddens, 1, bias_attr=False)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.attention_weights: Optional[paddle.Tensor] = None

    def _read_weights(self) -> CanonicalWeights:
        return canonical_from_stored(
            self.W_q.weight, self.W_k.weight, self.w_v.weight, to_numpy, stored_in_out=True
        )

    def _write_weights(self, weights: CanonicalWeights) -> None:
        for key, value in weights.items():
            param = getattr(self, key).weight
            layout = value.T if value.ndim == 2 else value[:, None]
            param.set_value(paddle.to_tensor(np.ascontiguousarray(layout)).astype(param.dtype))

    def _projections(self, queries):
        # computed in the inputs' dtype, the parameters cast to it; paddle stores them (in, out)
        W_q, W_k, w_v = (_as(linear.weight, queries.dtype) for linear in (self.W_q, self.W_k, self.w_v))
        return (lambda q: paddle.matmul(q, W_q)), (lambda k: paddle.matmul(k, W_k)), w_v[:, 0]

    def forward(self, queries, keys, values, valid_lens=None) -> paddle.Tensor:
        out, self.attention_weights = self._additive(queries, keys, values, valid_lens, self.dropout)
        return out


def _as(weight, dtype):
    return weight if weight.dtype == dtype else weight.astype(dtype)
