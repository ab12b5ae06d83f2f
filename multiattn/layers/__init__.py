"""The framework-native layer classes, one module per framework (``multiattn.layers.torch``,
...), and what they all share: argument checks, canonical weights and the call into
``multiattn.strategies`` (``AttentionCall``).

The canonical (math) layout of the additive weights is the one of d2l's
formula a(q, k) = w_v^T tanh(W_q q + W_k k):
W_q (num_hiddens, query_size), W_k (num_hiddens, key_size), w_v (num_hiddens,).
Adapters only say how to read and write their own parameters in that layout.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from .. import strategies
from ..protocol import Ops, Tensor

WEIGHT_NAMES = ("W_q", "W_k", "w_v")
CanonicalWeights = Dict[str, np.ndarray]


def check_dropout(dropout: Any) -> float:
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    return float(dropout)


def check_size(arg: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{arg} must be a positive integer, got {value!r}")
    return int(value)


def check_sizes(key_size: Any, query_size: Any, num_hiddens: Any) -> tuple[int, int, int]:
    return (
        check_size("key_size", key_size),
        check_size("query_size", query_size),
        check_size("num_hiddens", num_hiddens),
    )


def weight_shapes(key_size: int, query_size: int, num_hiddens: int) -> dict[str, tuple[int, ...]]:
    return {"W_q": (num_hiddens, query_size), "W_k": (num_hiddens, key_size), "w_v": (num_hiddens,)}


def canonical_weights(
    weights: Mapping[str, Any], key_size: int, query_size: int, num_hiddens: int
) -> CanonicalWeights:
    """Check a {"W_q", "W_k", "w_v"} dict against the layer's sizes; numpy copies."""
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"weights must be a dict with keys {', '.join(WEIGHT_NAMES)}, got {type(weights).__name__}"
        )
    unknown = sorted(set(weights) - set(WEIGHT_NAMES))
    missing = [k for k in WEIGHT_NAMES if k not in weights]
    if unknown or missing:
        raise ValueError(
            f"weights must have exactly the keys {', '.join(WEIGHT_NAMES)}; "
            f"missing {missing or 'none'}, unknown {unknown or 'none'}"
        )
    out = {}
    for key, expected in weight_shapes(key_size, query_size, num_hiddens).items():
        value = np.array(weights[key])  # a copy: the layer never aliases the caller's array
        if value.shape != expected:
            raise ValueError(f"weights[{key!r}] must have shape {expected}, got {value.shape}")
        if value.dtype.kind not in "iuf":
            raise ValueError(f"weights[{key!r}] must be real numbers, got dtype {value.dtype}")
        out[key] = value
    return out


def canonical_from_stored(
    W_q: Any, W_k: Any, w_v: Any, to_numpy: Callable[[Any], np.ndarray], stored_in_out: bool
) -> CanonicalWeights:
    """The canonical dict from a layer's own parameters, stored (out, in) as torch, mlx and
    mxnet do, or (in, out) as Keras, flax and paddle do (stored_in_out); w_v any shape."""
    W_q, W_k = to_numpy(W_q), to_numpy(W_k)
    if stored_in_out:
        W_q, W_k = W_q.T, W_k.T
    return {"W_q": np.array(W_q), "W_k": np.array(W_k), "w_v": np.array(to_numpy(w_v)).reshape(-1)}


class CanonicalWeightsMixin:
    """get_weights()/set_weights() in the canonical layout, for every adapter.

    A subclass sets key_size, query_size, num_hiddens, says how its framework stores the
    weights (``_stored_in_out``: (in, out) as Keras, flax and paddle; else (out, in) as torch,
    mlx and mxnet), hands them out with ``_stored_weights()`` -> (W_q, W_k, w_v (h,)), its
    framework's tensors as stored, and implements _write_weights(dict of numpy arrays).
    """

    key_size: int
    query_size: int
    num_hiddens: int
    _stored_in_out: bool = False
    _to_numpy: Callable[[Any], np.ndarray]

    def _stored_weights(self) -> Tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def _read_weights(self) -> CanonicalWeights:
        return canonical_from_stored(*self._stored_weights(), self._to_numpy, self._stored_in_out)

    def _write_weights(self, weights: CanonicalWeights) -> None:
        raise NotImplementedError

    def get_weights(self) -> CanonicalWeights:
        """{"W_q": (h, query_size), "W_k": (h, key_size), "w_v": (h,)} as numpy arrays."""
        return self._read_weights()

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Load weights given in the canonical layout (see get_weights)."""
        self._write_weights(canonical_weights(weights, self.key_size, self.query_size, self.num_hiddens))


class AttentionCall:
    """The call from a layer into the strategies, shared by every framework's classes.

    A framework's layers set ``_ops`` (the backend's ``Ops``); additive layers are also
    ``CanonicalWeightsMixin``s (their ``_stored_weights`` and ``_stored_in_out``).
    """

    _ops: Ops
    query_size: Optional[int] = None
    key_size: Optional[int] = None

    def _dot_product(self, queries, keys, values, valid_lens, dropout, need_weights=True):
        """(output, weights or None) of dot-product attention."""
        self._ops.check_tensors(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        return strategies.dot_product_attention(
            self._ops, queries, keys, values, valid_lens, dropout, need_weights
        )

    def _additive(self, queries, keys, values, valid_lens, dropout):
        """(output, weights) of additive attention with this layer's parameters."""
        ops = self._ops
        ops.check_tensors(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        # computed in the inputs' dtype, the parameters cast to it (no-op where they match)
        W_q, W_k, w_v = (ops.cast(p, queries) for p in self._stored_weights())
        product = ops.matmul if self._stored_in_out else ops.matmul_t
        return strategies.additive_attention(
            ops, queries, keys, values, valid_lens,
            project_q=lambda q: product(q, W_q), project_k=lambda k: product(k, W_k), w_v=w_v,
            query_size=self.query_size, key_size=self.key_size, dropout=dropout,
        )  # fmt: skip
