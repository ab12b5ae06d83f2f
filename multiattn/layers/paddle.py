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
    check_dropout,
    check_sizes,
)


class DotProductAttention(AttentionCall, nn.Layer):
    """Scaled dot-product attention; dropout in train mode only (``.train()``/``.eval()``)."""

    _ops, _to_numpy = ops, staticmethod(to_numpy)

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

    _stored_in_out = True

    _ops, _to_numpy = ops, staticmethod(to_numpy)

    def __init__(self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)
        self.W_k = nn.Linear(self.key_size, self.num_hiddens, bias_attr=False)
        self.W_q = nn.Linear(self.query_size, self.num_hiddens, bias_attr=False)
        self.w_v = nn.Linear(self.num_hiddens, 1, bias_attr=False)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.attention_weights: Optional[paddle.Tensor] = None

    def _write_weights(self, weights: CanonicalWeights) -> None:
        for key, value in weights.items():
            param = getattr(self, key).weight
            layout = value.T if value.ndim == 2 else value[:, None]
            param.set_value(paddle.to_tensor(np.ascontiguousarray(layout)).astype(param.dtype))

    def _stored_weights(self):
        return self.W_q.weight, self.W_k.weight, self.w_v.weight[:, 0]  # W_q, W_k stored (in, out); w_v (h,)

    def forward(self, queries, keys, values, valid_lens=None) -> paddle.Tensor:
        out, self.attention_weights = self._additive(queries, keys, values, valid_lens, self.dropout)
        return out
