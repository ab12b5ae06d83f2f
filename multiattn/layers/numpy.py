"""numpy layers: parameters as numpy arrays, initial weights and dropout masks from a
seedable ``numpy.random.Generator``, a ``training`` flag (``.train()``/``.eval()``)."""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np

from ..backends.numpy import ops, to_numpy
from . import (
    AdditiveWeights,
    AttentionCall,
    MultiHeadWeights,
    check_dropout,
)

Seed = Union[None, int, np.random.Generator]


class _Layer(AttentionCall):
    """The training flag, dropout and parameters (attributes by canonical name, stored (out, in))."""

    _ops, _to_numpy = ops, staticmethod(to_numpy)

    def __init__(self, dropout: float, seed: Seed) -> None:
        self.dropout = check_dropout(dropout)
        self.rng = np.random.default_rng(seed)
        self.training = True
        self.attention_weights: Optional[np.ndarray] = None

    def train(self, mode: bool = True):
        self.training = bool(mode)
        return self

    def eval(self):
        return self.train(False)

    def _dropout(self, weights: np.ndarray) -> np.ndarray:
        if not self.training or self.dropout == 0.0:
            return weights
        keep = self.rng.random(weights.shape) >= self.dropout
        return np.where(keep, weights / (1.0 - self.dropout), 0).astype(weights.dtype)

    def _init_parameters(self, dtype: Any) -> None:
        """Every weight uniform in +-1/sqrt(fan_in), as ``torch.nn.Linear``."""
        self.dtype = np.dtype(dtype)
        for name, shape in self._weight_shapes().items():
            fan_in = self._weight_shapes()["W" + name[1:]][-1] if name.startswith("b_") else shape[-1]
            bound = 1.0 / np.sqrt(fan_in)
            setattr(self, name, self.rng.uniform(-bound, bound, shape).astype(self.dtype))

    def _parameter(self, name):
        return getattr(self, name)

    def _assign(self, name, value):
        setattr(self, name, value.astype(self.dtype))

    def __call__(self, queries, keys, values, valid_lens=None, **keywords):
        """The output; ``keywords``: attention_mask, causal, score_mod, mask_mod, block_mask
        (not for additive attention) and cache (multi-head attention only)."""
        out, self.attention_weights = self._attend(queries, keys, values, valid_lens, self._dropout, keywords)
        return out


class DotProductAttention(_Layer):
    """Scaled dot-product attention; ``seed`` seeds the dropout masks."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True, *, seed: Seed = None) -> None:
        super().__init__(dropout, seed)
        self.need_weights = need_weights  # False: attention_weights is not kept


class AdditiveAttention(AdditiveWeights, _Layer):
    """Additive attention with parameters W_q, W_k, w_v in the canonical layout.

    Initialised like ``torch.nn.Linear`` (uniform in +-1/sqrt(fan_in)) from
    ``seed``; ``dtype`` is the parameters' dtype.  The computation runs in the
    inputs' dtype, so the output dtype is the input dtype.
    """

    def __init__(
        self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0, *, seed: Seed = None,
        dtype: Any = "float32",
    ) -> None:  # fmt: skip
        self._set_sizes(key_size, query_size, num_hiddens)
        super().__init__(dropout, seed)
        self._init_parameters(dtype)

    def _w_v(self):
        return self.w_v


class MultiHeadAttention(MultiHeadWeights, _Layer):
    """Multi-head attention (d2l 11.5) with W_q, W_k, W_v, W_o (and b_q, b_k, b_v, b_o with
    bias) in the canonical layout, initialised as ``AdditiveAttention``'s.

    ``attention_weights``: (batch, num_heads, queries, keys) before dropout (d2l's
    (batch * num_heads, queries, keys) is ``attention_weights.reshape(-1, Q, K)``).
    ``num_kv_heads`` (default num_heads): grouped-query attention, W_k and W_v projecting to
    num_kv_heads heads of num_hiddens / num_heads, query head i using key/value head
    i // (num_heads / num_kv_heads).
    """

    def __init__(
        self, num_hiddens: int, num_heads: int, dropout: float = 0.0, bias: bool = False, *,
        query_size: Optional[int] = None, key_size: Optional[int] = None, value_size: Optional[int] = None,
        need_weights: bool = True, num_kv_heads: Optional[int] = None, seed: Seed = None,
        dtype: Any = "float32",
    ) -> None:  # fmt: skip
        self._set_sizes(num_hiddens, num_heads, (query_size, key_size, value_size), bias, num_kv_heads)
        self.need_weights = need_weights
        super().__init__(dropout, seed)
        self._init_parameters(dtype)
