"""The functional API of a backend, bound once from its ops and its tensor check.

Every adapter gets the same four functions; only the ops object and the check that
arguments are the adapter's own tensors differ.  Each checks its arguments
(``validation``), gathers the masks into one value and enters the core function of its
name.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping, Tuple

from . import core, state, validation
from ._registry import known_types
from .adapter import Ops
from .block_mask import unpacked
from .protocol import Tensor


def bind(ops: Ops) -> Tuple[Callable[..., Any], ...]:
    """(masked_softmax, dot_product_attention, additive_attention, multi_head_attention) for
    one backend.

    The framework check (``ops.check_tensors``) is skipped for types already seen as the
    backend's tensors (its call costs a few us, a tenth of a toy-sized attention), unless
    the adapter checks more than the framework."""
    known = known_types(ops.name) if type(ops).check_tensors is Ops.check_tensors else set()
    check = ops.check_tensors

    def masked_softmax(
        X: Tensor,
        valid_lens: Tensor = None,
        *,
        attention_mask: Tensor = None,
        causal: bool = False,
        score_mod: Any = None,
        mask_mod: Any = None,
        **unknown: Any,
    ) -> Tensor:
        """Softmax over X's last axis; hidden positions (j >= valid_lens, attention_mask
        False, j > i when causal, mask_mod False) are exactly 0; score_mod first, on X."""
        if unknown:
            validation.unknown_keywords("masked_softmax", unknown, keywords["masked_softmax"])
        if not (
            type(X) in known
            and (valid_lens is None or type(valid_lens) in known)
            and (attention_mask is None or type(attention_mask) in known)
        ):
            check(X=X, valid_lens=valid_lens, attention_mask=attention_mask)
        masks = validation.softmax_call(ops, X, valid_lens, attention_mask, causal)
        shape = ops.shape(X)
        sizes = (shape[0], shape[-2], shape[-1]) if len(shape) >= 2 else None
        score_mod, masks = validation.with_mods(score_mod, mask_mod, masks, sizes)
        return core.masked_softmax(ops, X, masks, score_mod=score_mod)

    def dot_product_attention(
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor = None,
        *,
        attention_mask: Tensor = None,
        causal: bool = False,
        return_weights: bool = False,
        return_lse: bool = False,
        block_size: Any = None,
        score_mod: Any = None,
        mask_mod: Any = None,
        scale: Any = None,
        block_mask: Any = None,
        query_offset: Any = None,
        **unknown: Any,
    ) -> Any:
        """softmax(scale Q K^T) V (scale: 1 / sqrt(d)); 3-D (B, Q, d) or 4-D (B, H, Q, d) with
        keys and values (B, H_kv, K, .), H_kv dividing H; with return_weights, (output,
        weights); with return_lse, lse (B, [H,] Q) last: the log of the sum of exp of each
        row's visible scores.  score_mod and mask_mod: ``multiattn.mods``; block_mask: every
        mask as one value (``multiattn.create_block_mask``), instead of the mask arguments.
        query_offset: query row i sits at position query_offset + i (an int, or (B,) ints), so
        causal hides key j iff j > query_offset + i (decoding), and the mods see those positions.

        Without return_weights the framework's fused kernel runs where there is one, and the
        scores are computed in blocks of block_size (None: where they would not fit).
        """
        if unknown:
            validation.unknown_keywords("dot_product_attention", unknown, keywords["dot_product_attention"])

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
        if block_mask is not None:
            valid_lens, attention_mask, causal, mask_mod, block_size = unpacked(
                block_mask, ops, queries, keys, valid_lens, attention_mask, causal, mask_mod, block_size,
                return_weights,
            )  # fmt: skip
        masks = validation.dot_product_call(ops, queries, keys, values, valid_lens, attention_mask, causal)
        if score_mod is not None or mask_mod is not None or query_offset is not None:
            sizes = validation.mod_sizes(ops, queries, keys, query_offset)
            score_mod, masks = validation.with_mods(score_mod, mask_mod, masks, sizes)
            if query_offset is not None:
                validation.check_not_both(block_mask, query_offset)
                score_mod, masks = validation.with_query_offset(ops, query_offset, masks, score_mod, sizes)
        if block_mask is not None:
            masks = masks.with_block_mask(block_mask)
        flags = return_lse is False and (return_weights is True or return_weights is False)
        if not (flags and block_size is None and scale is None):  # the defaults need no check
            block_size = validation.check_block_size(block_size, return_weights)
            validation.check_flag("return_lse", return_lse)
            scale = validation.check_scale(scale)
        result = core.dot_product_attention(
            ops, queries, keys, values, masks, need_weights=return_weights, block_size=block_size,
            need_lse=return_lse, score_mod=score_mod, scale=scale,
        )  # fmt: skip
        if return_weights is True and return_lse is False:
            return result  # (output, weights) as the core gives them
        return validation.returned(result, return_weights, return_lse)

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
        block_size: Any = None,
        score_mod: Any = None,
        mask_mod: Any = None,
        **unknown: Any,
    ) -> Any:
        """Additive attention with canonical weights W_q (h, q), W_k (h, k), w_v (h,);
        without return_weights in blocks of block_size (None: where the scores would not fit).
        score_mod and mask_mod: ``multiattn.mods``."""
        if unknown:
            validation.unknown_keywords("additive_attention", unknown, keywords["additive_attention"])
        check(
            queries=queries, keys=keys, values=values, valid_lens=valid_lens, W_q=W_q, W_k=W_k, w_v=w_v,
            attention_mask=attention_mask,
        )  # fmt: skip
        query_size, key_size = validation.check_additive_weights(ops, W_q, W_k, w_v, queries)
        masks = validation.additive_call(
            ops, queries, keys, values, valid_lens, attention_mask, causal, query_size, key_size
        )
        score_mod, masks = validation.with_mods(
            score_mod, mask_mod, masks, validation.mod_sizes(ops, queries, keys)
        )
        block_size = validation.check_block_size(block_size, return_weights)
        out, weights = core.additive_attention(
            ops, queries, keys, values, masks, w_v=w_v,
            project_q=lambda q: ops.matmul_t(q, W_q), project_k=lambda k: ops.matmul_t(k, W_k),
            need_weights=return_weights, block_size=block_size, score_mod=score_mod,
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
        block_size: Any = None,
        score_mod: Any = None,
        mask_mod: Any = None,
        num_kv_heads: Any = None,
        scale: Any = None,
        block_mask: Any = None,
        query_offset: Any = None,
        **unknown: Any,
    ) -> Any:
        """Multi-head attention (d2l 11.5) with canonical weights W_q (h, q), W_k (h, k),
        W_v (h, v), W_o (h, h) and optionally b_q, b_k, b_v, b_o (h,); with return_weights,
        (output (B, Q, h), weights (B, num_heads, Q, K)); without, in blocks of block_size
        (None: where the scores would not fit).  num_kv_heads: grouped-query attention, W_k,
        W_v (and b_k, b_v) of num_kv_heads * h / num_heads rows, query head i using key/value
        head i // (num_heads / num_kv_heads).  scale: of each head's q k^T (None: 1 / sqrt(h /
        num_heads)).  block_mask: every mask as one value (``multiattn.create_block_mask``).
        query_offset: query row i sits at position query_offset + i (``dot_product_attention``)."""
        if unknown:
            validation.unknown_keywords("multi_head_attention", unknown, keywords["multi_head_attention"])
        tensors = {f"weights[{k!r}]": w for k, w in weights.items()} if hasattr(weights, "items") else {}
        check(
            queries=queries, keys=keys, values=values, valid_lens=valid_lens, attention_mask=attention_mask,
            **tensors,
        )  # fmt: skip
        validation.check_attention_inputs(ops, queries, keys, values, valid_lens)
        num_kv_heads = validation.check_multi_head_weights(
            ops, weights, num_heads, queries, keys, values, num_kv_heads
        )
        num_hiddens = ops.shape(weights["W_q"])[0]
        if block_mask is not None:
            valid_lens, attention_mask, causal, mask_mod, block_size = unpacked(
                block_mask, ops, queries, keys, valid_lens, attention_mask, causal, mask_mod, block_size,
                return_weights,
            )  # fmt: skip
        block_size = validation.check_block_size(block_size, return_weights)
        masks = validation.multi_head_call(
            ops, queries, keys, values, valid_lens, attention_mask, causal, num_heads, num_hiddens
        )
        sizes = validation.mod_sizes(ops, queries, keys, query_offset)
        score_mod, masks = validation.with_mods(score_mod, mask_mod, masks, sizes)
        if query_offset is not None:
            validation.check_not_both(block_mask, query_offset)
            score_mod, masks = validation.with_query_offset(ops, query_offset, masks, score_mod, sizes)
        masks = masks.with_block_mask(block_mask)
        project = {
            n: functools.partial(core.linear, ops, W=weights["W_" + n], b=weights.get("b_" + n))
            for n in "qkvo"
        }
        out, attention = core.multi_head_attention(
            ops, queries, keys, values, masks, project=project, num_heads=num_heads, num_hiddens=num_hiddens,
            need_weights=return_weights, block_size=block_size, score_mod=score_mod,
            num_kv_heads=num_kv_heads, scale=validation.check_scale(scale),
        )  # fmt: skip
        return (out, attention) if return_weights else out

    functions = masked_softmax, dot_product_attention, additive_attention, multi_head_attention
    keywords = {f.__name__: [p for p in inspect.signature(f).parameters if p != "unknown"] for f in functions}
    return functions


def combine_attention(ops: Ops, parts: Any) -> Tuple[Tensor, Tensor]:
    """(output, lse) of attention over the union of disjoint key sets, from each set's
    (output (B, [H,] Q, v), lse (B, [H,] Q)) as ``dot_product_attention(..., return_lse=True)``
    gives them: exact, the merge of ring attention."""
    parts = validation.check_attention_parts(ops, parts)
    return state.combine(ops, parts)
