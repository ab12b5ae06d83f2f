"""MXNet layers: Gluon blocks on MXNet's numpy interface; dropout only inside
``autograd.record()`` (MXNet's training mode)."""

from __future__ import annotations

from typing import Any, Optional

from mxnet import np
from mxnet.gluon import nn

from ..backends.mxnet import ops, to_numpy
from . import (
    AdditiveWeights,
    AttentionCall,
    MultiHeadWeights,
    check_dropout,
    check_sizes,
)


class _Block(AttentionCall, nn.Block):
    """The ops and the parameters of the Gluon blocks (Dense weights stored (out, in))."""

    _ops, _to_numpy = ops, staticmethod(to_numpy)

    def __call__(
        self,
        queries,
        keys,
        values,
        valid_lens=None,
        *,
        attention_mask=None,
        causal=False,
        score_mod=None,
        mask_mod=None,
        block_mask=None,
        cache=None,
        **unknown,
    ):
        if cache is not None and not isinstance(self, MultiHeadWeights):
            unknown["cache"] = cache
        self._no_unknown(unknown)
        # Gluon's Block.__call__ passes positional arguments only
        decoding = () if cache is None else (cache,)
        return super().__call__(
            queries,
            keys,
            values,
            valid_lens,
            attention_mask,
            causal,
            score_mod,
            mask_mod,
            block_mask,
            *decoding,
        )

    def _parameter(self, name):
        return self._variable(name).data()

    def _assign(self, name, value):
        param = self._variable(name)
        param.set_data(np.array(value.reshape(param.shape), dtype=param.dtype))


class DotProductAttention(_Block):
    """Scaled dot-product attention; dropout only inside ``autograd.record()``."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.need_weights = need_weights  # False: attention_weights is not kept
        self.attention_weights = None

    def forward(
        self,
        queries,
        keys,
        values,
        valid_lens=None,
        attention_mask=None,
        causal=False,
        score_mod=None,
        mask_mod=None,
        block_mask=None,
        **unknown,
    ):
        self._no_unknown(unknown)
        out, self.attention_weights = self._dot_product(
            queries,
            keys,
            values,
            valid_lens,
            self.dropout,
            self.need_weights,
            attention_mask,
            causal,
            score_mod,
            mask_mod,
            block_mask=block_mask,
        )
        return out


class AdditiveAttention(AdditiveWeights, _Block):
    """Additive attention with ``nn.Dense(use_bias=False, flatten=False)``; weights (out, in).

    The parameters are initialised at construction (the sizes are known), so
    there is no ``initialize()`` to call; calling it anyway only warns.
    """

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

    def _w_v(self):
        return self.w_v.weight.data()[0]

    def forward(
        self,
        queries,
        keys,
        values,
        valid_lens=None,
        attention_mask=None,
        causal=False,
        score_mod=None,
        mask_mod=None,
        block_mask=None,
        **unknown,
    ):
        self._no_unknown(dict(unknown, block_mask=block_mask) if block_mask is not None else unknown)
        out, self.attention_weights = self._additive(
            queries, keys, values, valid_lens, self.dropout, attention_mask, causal, score_mod, mask_mod
        )
        return out


class MultiHeadAttention(MultiHeadWeights, _Block):
    """Multi-head attention (d2l 11.5) with ``nn.Dense(flatten=False)`` maps W_q, W_k, W_v,
    W_o (weights (out, in), biases with ``bias=True``), initialised at construction.

    ``attention_weights``: (batch, num_heads, queries, keys) before dropout.
    ``num_kv_heads`` (default num_heads): grouped-query attention, W_k and W_v projecting to
    num_kv_heads heads of num_hiddens / num_heads, query head i using key/value head
    i // (num_heads / num_kv_heads).
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = False,
        *,
        query_size: Optional[int] = None,
        key_size: Optional[int] = None,
        value_size: Optional[int] = None,
        need_weights: bool = True,
        num_kv_heads: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._set_sizes(num_hiddens, num_heads, (query_size, key_size, value_size), bias, num_kv_heads)
        self.need_weights = need_weights
        dense = dict(use_bias=self.bias, flatten=False)
        self.W_q = nn.Dense(self.num_hiddens, in_units=self.query_size, **dense)
        self.W_k = nn.Dense(self._kv_hiddens(), in_units=self.key_size, **dense)
        self.W_v = nn.Dense(self._kv_hiddens(), in_units=self.value_size, **dense)
        self.W_o = nn.Dense(self.num_hiddens, in_units=self.num_hiddens, **dense)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.attention_weights = None
        self.initialize()

    def forward(
        self,
        queries,
        keys,
        values,
        valid_lens=None,
        attention_mask=None,
        causal=False,
        score_mod=None,
        mask_mod=None,
        block_mask=None,
        cache=None,
        **unknown,
    ):
        self._no_unknown(unknown)
        out, self.attention_weights = self._multi_head(
            queries,
            keys,
            values,
            valid_lens,
            self.dropout,
            self.need_weights,
            attention_mask,
            causal,
            score_mod,
            mask_mod,
            block_mask=block_mask,
            cache=cache,
        )
        return out
