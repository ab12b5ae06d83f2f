"""The functional API of a backend, bound once from its ops and its tensor check.

Every adapter gets the same three functions; only the ops object and the
check that arguments are the adapter's own tensors differ.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

from . import strategies
from ._registry import known_types
from .protocol import Ops, Tensor


def bind(ops: Ops) -> Tuple[Callable[..., Any], ...]:
    """(masked_softmax, dot_product_attention, additive_attention) for one backend.

    The framework check (``ops.check_tensors``) is skipped for types already seen as the
    backend's tensors (its call costs a few us, a tenth of a toy-sized attention), unless
    the adapter checks more than the framework."""
    known = known_types(ops.name) if type(ops).check_tensors is Ops.check_tensors else set()
    check = ops.check_tensors

    def masked_softmax(X: Tensor, valid_lens: Tensor = None) -> Tensor:
        """Softmax over X's last axis; positions >= valid_lens are exactly 0."""
        if not (type(X) in known and (valid_lens is None or type(valid_lens) in known)):
            check(X=X, valid_lens=valid_lens)
        return strategies.masked_softmax(ops, X, valid_lens)

    def dot_product_attention(
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor = None,
        *,
        return_weights: bool = False,
    ) -> Any:
        """softmax(Q K^T / sqrt(d)) V; with return_weights, (output, weights).

        Without return_weights the framework's fused kernel runs where there is one.
        """
        if not (
            type(queries) in known
            and type(keys) in known
            and type(values) in known
            and (valid_lens is None or type(valid_lens) in known)
        ):
            check(queries=queries, keys=keys, values=values, valid_lens=valid_lens)
        out, weights = strategies.dot_product_attention(
            ops, queries, keys, values, valid_lens, need_weights=return_weights
        )
        return (out, weights) if return_weights else out

    def additive_attention(
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor = None,
        *,
        W_q: Tensor,
        W_k: Tensor,
        w_v: Tensor,
        return_weights: bool = False,
    ) -> Any:
        """Additive attention with canonical weights W_q (h, q), W_k (h, k), w_v (h,)."""
        check(queries=queries, keys=keys, values=values, valid_lens=valid_lens, W_q=W_q, W_k=W_k, w_v=w_v)
        out, weights = strategies.additive_attention_from_weights(
            ops, queries, keys, values, valid_lens, W_q=W_q, W_k=W_k, w_v=w_v
        )
        return (out, weights) if return_weights else out

    return masked_softmax, dot_product_attention, additive_attention
