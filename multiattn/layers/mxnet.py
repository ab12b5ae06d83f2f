"""MXNet layers: Gluon blocks on MXNet's numpy interface; dropout only inside
``autograd.record()`` (MXNet's training mode)."""

from __future__ import annotations

from typing import Any

from mxnet import np
from mxnet.gluon import nn

from ..backends.mxnet import ops, to_numpy
from . import (
    AttentionCall,
    CanonicalWeights,
    CanonicalWeightsMixin,
    check_dropout,
    check_sizes,
)


class DotProductAttention(AttentionCall, nn.Block):
    """Scaled dot-product attention; dropout only inside ``autograd.record()``."""

    _ops, _to_numpy = ops, staticmethod(to_numpy)

    def __init__(self, dropout: float = 0.0, need_weights: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.need_weights = need_weights  # False: attention_weights is not kept
        self.attention_weights = None

    def forward(self, queries, keys, values, valid_lens=None):
        out, self.attention_weights = self._dot_product(
            queries, keys, values, valid_lens, self.dropout, self.need_weights
        )
        return out


class AdditiveAttention(CanonicalWeightsMixin, AttentionCall, nn.Block):
    """Additive attention with ``nn.Dense(use_bias=False, flatten=False)``; weights (out, in).

    The parameters are initialised at construction (the sizes are known), so
    there is no ``initialize()`` to call; calling it anyway only warns.
    """

    _stored_in_out = False

    _ops, _to_numpy = ops, staticmethod(to_numpy)

    def __init__(
        self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)
        dense = dict(use_bias=False, flatten=False)
        self.W_k = nn.Dense(self.num_hiddens, in_units=self.key_size, **dense)
        self.W_q = nn.Dense(self.num_hiddens, in_units=self.query_size, **dense)
        self.w_v = nn.Dense(1, in_units=self.num_hiddens, **dense)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.attention_weights = None
        self.initialize()

    def _write_weights(self, weights: CanonicalWeights) -> None:
        for key, value in weights.items():
            param = getattr(self, key).weight
            param.set_data(np.array(value.reshape(param.shape), dtype=param.dtype))

    def _stored_weights(self):
        return (
            self.W_q.weight.data(),
            self.W_k.weight.data(),
            self.w_v.weight.data()[0],
        )  # W_q, W_k stored (out, in); w_v (h,)

    def forward(self, queries, keys, values, valid_lens=None):
        out, self.attention_weights = self._additive(queries, keys, values, valid_lens, self.dropout)
        return out
