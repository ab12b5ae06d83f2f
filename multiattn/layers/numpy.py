"""numpy layers: parameters as numpy arrays, initial weights and dropout masks from a
seedable ``numpy.random.Generator``, a ``training`` flag (``.train()``/``.eval()``)."""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np

from ..backends.numpy import ops, to_numpy
from . import AttentionCall, CanonicalWeights, CanonicalWeightsMixin, check_dropout, check_sizes

Seed = Union[None, int, np.random.Generator]


class _Layer(AttentionCall):
    """The training flag and dropout of the numpy layers."""

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


class DotProductAttention(_Layer):
    """Scaled dot-product attention; ``seed`` seeds the dropout masks."""

    def __init__(self, dropout: float = 0.0, need_weights: bool = True, *, seed: Seed = None) -> None:
        super().__init__(dropout, seed)
        self.need_weights = need_weights  # False: attention_weights is not kept

    def __call__(self, queries, keys, values, valid_lens=None) -> np.ndarray:
        out, self.attention_weights = self._dot_product(
            queries, keys, values, valid_lens, self._dropout, self.need_weights
        )
        return out


class AdditiveAttention(CanonicalWeightsMixin, _Layer):
    """Additive attention with parameters W_q, W_k, w_v in the canonical layout.

    Initialised like ``torch.nn.Linear`` (uniform in +-1/sqrt(fan_in)) from
    ``seed``; ``dtype`` is the parameters' dtype.  The computation runs in the
    inputs' dtype, so the output dtype is the input dtype.
    """

    _stored_in_out = False

    def __init__(
        self,
        key_size: int,
        query_size: int,
        num_hiddens: int,
        dropout: float = 0.0,
        *,
        seed: Seed = None,
        dtype: Any = "float32",
    ) -> None:
        self.key_size, self.query_size, self.num_hiddens = check_sizes(key_size, query_size, num_hiddens)
        super().__init__(dropout, seed)
        self.dtype = np.dtype(dtype)

        def init(shape, fan_in):
            bound = 1.0 / np.sqrt(fan_in)
            return self.rng.uniform(-bound, bound, shape).astype(self.dtype)

        self.W_q = init((self.num_hiddens, self.query_size), self.query_size)
        self.W_k = init((self.num_hiddens, self.key_size), self.key_size)
        self.w_v = init((self.num_hiddens,), self.num_hiddens)

    def _write_weights(self, weights: CanonicalWeights) -> None:
        for key, value in weights.items():
            setattr(self, key, value.astype(self.dtype))

    def _stored_weights(self):
        return self.W_q, self.W_k, self.w_v  # W_q, W_k stored (out, in); w_v (h,)

    def __call__(self, queries, keys, values, valid_lens=None) -> np.ndarray:
        out, self.attention_weights = self._additive(queries, keys, values, valid_lens, self._dropout)
        return out
