"""The functional API of a backend, bound once from its ops and its tensor check.

Every adapter gets the same four functions; only the ops object and the check that
arguments are the adapter's own tensors differ.  Each checks its arguments
(``validation``), gathers the masks into one value and enters the core function of its
name.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Tuple

from . import core, validation
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
        return core.masked_softmax(
            ops, X, validation.softmax_call(ops, X, valid_lens, attention_mask, causal)
        )

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
        masks = validation.dot_product_call(ops, queries, keys, values, valid_lens, attention_mask, causal)
        out, weights = core.dot_product_attention(
            ops, queries, keys, values, masks, need_weights=return_weights
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
        attention_mask: Tensor = None,
        causal: bool = False,
        return_weights: bool = False,
    ) -> Any:
        """Additive attention with canonical weights W_q (h, q), W_k (h, k), w_v (h,)."""
        check(
            queries=queries, keys=keys, values=values, valid_lens=valid_lens, W_q=W_q, W_k=W_k, w_v=w_v,
            attention_mask=attention_mask,
        )  # fmt: skip
        query_size, key_size = validation.check_additive_weights(ops, W_q, W_k, w_v, queries)
        masks = validation.additive_call(
            ops, queries, keys, values, valid_lens, attention_mask, causal, query_size, key_size
        )
        out, weights = core.additive_attention(
            ops, queries, keys, values, masks, w_v=w_v,
            project_q=lambda q: ops.matmul_t(q, W_q), project_k=lambda k: ops.matmul_t(k, W_k),
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
        validation.check_attention_inputs(ops, queries, keys, values, valid_lens)
        validation.check_multi_head_weights(ops, weights, num_heads, queries, keys, values)
        num_hiddens = ops.shape(weights["W_q"])[0]
        masks = validation.multi_head_call(
            ops, queries, keys, values, valid_lens, attention_mask, causal, num_heads, num_hiddens
        )
        project = {
            n: functools.partial(core.linear, ops, W=weights["W_" + n], b=weights.get("b_" + n))
            for n in "qkvo"
        }
        out, attention = core.multi_head_attention(
            ops, queries, keys, values, masks, project=project, num_heads=num_heads, num_hiddens=num_hiddens,
            need_weights=return_weights,
        )  # fmt: skip
        return (out, attention) if return_weights else out

    return masked_softmax, dot_product_attention, additive_attention, multi_head_attention
