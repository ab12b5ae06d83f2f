"""The functional API of a backend, bound once from its ops and its tensor check.

Every adapter gets the same four functions; only the ops object and the
check that arguments are the adapter's own tensors differ.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Tuple

from . import strategies
from ._registry import known_types
from .protocol import Ops, Tensor


def bind(ops: Ops) -> Tuple[Callable[..., Any], ...]:
    """(masked_softmax, dot_product_attention, additive_attention, multi_head_attention) for
    one backend.

    The framework check (``ops.check_tensors``) is skipped for types already seen as the
    backend's tensors (its call costs a few us, a tenth of a toy-sized attention), unless
    the adapter checks more than the framework."""
    known = known_types(ops.name) if type(ops).check_tensors is Ops.check_tensors else set()
    check = ops.check_tensors

    def masked_softmax(
        X: Tensor, valid_lens: Tensor = None, *, attention_mask: Tensor = None, causal: bool = False
    ) -> Tensor:
        """Softmax over X's last axis; hidden positions (j >= valid_lens, attention_mask
        False, j > i when causal) are exactly 0."""
        if not (
            type(X) in known
            and (valid_lens is None or type(valid_lens) in known)
            and (attention_mask is None or type(attention_mask) in known)
        ):
            check(X=X, valid_lens=valid_lens, attention_mask=attention_mask)
        return strategies.masked_softmax(ops, X, valid_lens, attention_mask, causal)

    def dot_product_attention(
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor = None,
        *,
        attention_mask: Tensor = None,
        causal: bool = False,
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
            and (attention_mask is None or type(attention_mask) in known)
        ):
            check(
                queries=queries,
                keys=keys,
                values=values,
                valid_lens=valid_lens,
                attention_mask=attention_mask,
            )
        out, weights = strategies.dot_product_attention(
            ops, queries, keys, values, valid_lens, need_weights=return_weights,
            attention_mask=attention_mask, causal=causal,
        )  # fmt: skip
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
        attention_mask: Tensor = None,
        causal: bool = False,
        return_weights: bool = False,
    ) -> Any:
        """Additive attention with canonical weights W_q (h, q), W_k (h, k), w_v (h,)."""
        check(
            queries=queries, keys=keys, values=values, valid_lens=valid_lens, W_q=W_q, W_k=W_k, w_v=w_v,
            attention_mask=attention_mask,
        )  # fmt: skip
        out, weights = strategies.additive_attention_from_weights(
            ops, queries, keys, values, valid_lens, W_q=W_q, W_k=W_k, w_v=w_v,
            attention_mask=attention_mask, causal=causal,
        )  # fmt: skip
        return (out, weights) if return_weights else out

    def multi_head_attention(
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor = None,
        *,
        weights: Mapping[str, Tensor],
        num_heads: int,
        attention_mask: Tensor = None,
        causal: bool = False,
        return_weights: bool = False,
    ) -> Any:
        """Multi-head attention (d2l 11.5) with canonical weights W_q (h, q), W_k (h, k),
        W_v (h, v), W_o (h, h) and optionally b_q, b_k, b_v, b_o (h,); with return_weights,
        (output (B, Q, h), weights (B, num_heads, Q, K))."""
        tensors = {f"weights[{k!r}]": w for k, w in weights.items()} if hasattr(weights, "items") else {}
        check(
            queries=queries, keys=keys, values=values, valid_lens=valid_lens, attention_mask=attention_mask,
            **tensors,
        )  # fmt: skip
        out, attention = strategies.multi_head_attention_from_weights(
            ops, queries, keys, values, valid_lens, weights=weights, num_heads=num_heads,
            need_weights=return_weights, attention_mask=attention_mask, causal=causal,
        )  # fmt: skip
        return (out, attention) if return_weights else out

    return masked_softmax, dot_product_attention, additive_attention, multi_head_attention
