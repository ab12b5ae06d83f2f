"""MXNet layers: Gluon blocks on MXNet's numpy interface; dropout only inside
``autograd.record()`` (MXNet's training mode)."""

from __future__ import annotations

from typing import Any, Optional

from .._registry import framework_imports  # noqa: E402

with framework_imports("mxnet"):  # not installed: an error naming the install
    from mxnet import np
    from mxnet.gluon import nn

from ..backends.mxnet import ops, to_numpy
from . import (
    AdditiveWeights,
    AttentionCall,
    MultiHeadWeights,
    check_dropout,
)


class _Block(AttentionCall, nn.Block):
    """The ops and the parameters of the Gluon blocks (Dense weights stored (out, in))."""

    _ops, _to_numpy = ops, staticmethod(to_numpy)

    def __call__(self, queries, keys, values, valid_lens=None, **keywords):
        """The output; ``keywords``: attention_mask, causal, score_mod, mask_mod, block_mask
        (not for additive attention) and cache (multi-head attention only); one this layer does
        not take is ignored where None."""
        keywords = self._call_keywords(keywords, none_absent=True)
        # Gluon's Block.__call__ passes positional arguments only: the keywords in _takes' order
        return super().__call__(queries, keys, values, valid_lens, *keywords.values())

    def forward(self, queries, keys, values, valid_lens=None, *positional, **keywords):
        """``positional``: the keywords of ``_takes`` in order (as ``__call__`` passes them)."""
        keywords.update(zip(self._takes, positional))
        out, self.attention_weights = self._attend(queries, keys, values, valid_lens, self.dropout, keywords)
        return out

    def _parameter(self, name):
        return self._variable(name).data()

    def _assign(self, name, value):
        param = self._variable(name)
        param.set_data(np.array(value.reshape(param.shape), dtype=param.dtype))

    def _add_linear(self, name, in_size, out_size, bias):
        setattr(self, name, nn.Dense(out_size, in_units=in_size, use_bias=bias, flatten=False))

    def _add_dropout(self, dropout: float) -> None:
        """The dropout and attention_weights, and the parameters initialised (the sizes are known)."""
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.attention_weights = None
        self.initialize()


class DotProductAttention(_Block):
    """Scaled dot-product attention; dropout only inside ``autograd.record()``."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.need_weights = need_weights  # False: attention_weights is not kept
        self.attention_weights = None


class AdditiveAttention(AdditiveWeights, _Block):
    """Additive attention with ``nn.Dense(use_bias=False, flatten=False)``; weights (out, in).

    The parameters are initialised at construction (the sizes are known), so
    there is no ``initialize()`` to call; calling it anyway only warns.
    """

    def __init__(
        self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._set_sizes(key_size, query_size, num_hiddens)
        self._build()
        self._add_dropout(dropout)

    def _w_v(self):
        return self.w_v.weight.data()[0]


class MultiHeadAttention(MultiHeadWeights, _Block):
    """Multi-head attention (d2l 11.5) with ``nn.Dense(flatten=False)`` maps W_q, W_k, W_v,
    W_o (weights (out, in), biases with ``bias=True``), initialised at construction.

    ``attention_weights``: (batch, num_heads, queries, keys) before dropout.
    ``num_kv_heads`` (default num_heads): grouped-query attention, W_k and W_v projecting to
    num_kv_heads heads of num_hiddens / num_heads, query head i using key/value head
    i // (num_heads / num_kv_heads).
    """

    def __init__(
        self, num_hiddens: int, num_heads: int, dropout: float = 0.0, bias: bool = False, *,
        query_size: Optional[int] = None, key_size: Optional[int] = None, value_size: Optional[int] = None,
        need_weights: bool = True, num_kv_heads: Optional[int] = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self._set_sizes(num_hiddens, num_heads, (query_size, key_size, value_size), bias, num_kv_heads)
        self.need_weights = need_weights
        self._build()
        self._add_dropout(dropout)
