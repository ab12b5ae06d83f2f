"""multiattn: the attention of d2l 11.3 and 11.5, once, for every framework.

Importing this package imports no framework.  Two ways in:

* functions that follow the tensors: ``masked_softmax``, ``dot_product_attention``
  run on whichever framework made their arguments;
* layer classes of the backend named by ``MULTIATTN_BACKEND`` (default numpy):
  ``multiattn.AdditiveAttention``, ``multiattn.DotProductAttention``,
  ``multiattn.MultiHeadAttention``, or of any
  backend via ``multiattn.get_backend(name)``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from . import mods
from ._registry import (
    BACKENDS,
    ENV_VAR,
    BackendImportError,
    framework_of_call,
    get_backend,
    loaded_backend_of,
)
from ._registry import selected_backend as _selected_backend
from .cache import KVCache, cached_attention
from .specialise import explained, primitives_only
from .validation import InputDtypeError

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention",
    "BACKENDS",
    "BackendImportError",
    "DotProductAttention",
    "ENV_VAR",
    "InputDtypeError",
    "MultiHeadAttention",
    "additive_attention",
    "backend",
    "combine_attention",
    "KVCache",
    "cached_attention",
    "create_block_mask",
    "dot_product_attention",
    "explained",
    "get_backend",
    "masked_softmax",
    "mods",
    "multi_head_attention",
    "primitives_only",
]


def backend() -> str:
    """The name of the selected backend: MULTIATTN_BACKEND, or 'numpy' when unset."""
    return _selected_backend()


def masked_softmax(
    X: Any,
    valid_lens: Any = None,
    *,
    attention_mask: Any = None,
    causal: bool = False,
    score_mod: Any = None,
    mask_mod: Any = None,
    **unknown: Any,
) -> Any:
    """Softmax over X's last axis, hidden positions exactly 0, on X's framework: positions
    >= valid_lens, where attention_mask is False (True: may attend), j > i when causal, and
    where mask_mod(b, h, q_idx, kv_idx) is False; score_mod(score, b, h, q_idx, kv_idx) first,
    on X (``multiattn.mods``)."""
    module = loaded_backend_of(X, valid_lens, attention_mask) or get_backend(
        framework_of_call(X=X, valid_lens=valid_lens, attention_mask=attention_mask)
    )
    return module.masked_softmax(
        X,
        valid_lens,
        attention_mask=attention_mask,
        causal=causal,
        score_mod=score_mod,
        mask_mod=mask_mod,
        **unknown,
    )


def dot_product_attention(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    attention_mask: Any = None,
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
    """softmax(scale Q K^T) V with masking (scale: 1 / sqrt(d) by default), on the framework
    of the arguments.  queries (B, Q, d) or, torch SDPA's layout, (B, H, Q, d); keys and
    values (B, K, .) or (B, H_kv, K, .), each key/value head shared by H / H_kv query heads
    (grouped-query attention: query head i uses key/value head i // (H / H_kv)).

    With ``return_weights=True`` returns ``(output, attention_weights)``; with
    ``return_lse=True`` also (last) lse (B, Q), the log of the sum of exp of each row's
    visible scores (-inf where none is), for ``combine_attention``.  Without the weights the
    scores are computed in blocks of ``block_size`` (None: automatically, where they would
    not fit the budget; ``multiattn.blockwise``).  ``score_mod(score, b, h, q_idx, kv_idx)``
    on the scaled scores and ``mask_mod(b, h, q_idx, kv_idx)`` ANDed with the masks: your
    own or ready-made ones (``multiattn.mods``).  ``block_mask``: all of the masks as one value
    made once by ``create_block_mask`` and reused, instead of the mask arguments.
    ``query_offset``: query row i sits at position query_offset + i (an int, or one per
    sequence), after the keys of a cache: ``causal`` hides key j iff j > query_offset + i, and
    the mods see those positions (docs/decoding.md).
    """
    module = loaded_backend_of(queries, keys, values, valid_lens, attention_mask) or get_backend(
        framework_of_call(
            queries=queries, keys=keys, values=values, valid_lens=valid_lens, attention_mask=attention_mask
        )
    )
    return module.dot_product_attention(
        queries, keys, values, valid_lens, attention_mask=attention_mask, causal=causal,
        return_weights=return_weights, return_lse=return_lse, block_size=block_size,
        score_mod=score_mod, mask_mod=mask_mod, scale=scale, block_mask=block_mask,
        query_offset=query_offset, **unknown,
    )  # fmt: skip


def additive_attention(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    W_q: Any,
    W_k: Any,
    w_v: Any,
    attention_mask: Any = None,
    causal: bool = False,
    return_weights: bool = False,
    block_size: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    **unknown: Any,
) -> Any:
    """Additive attention with weight tensors in the canonical layout, on their framework:
    W_q (num_hiddens, query_size), W_k (num_hiddens, key_size), w_v (num_hiddens,).
    block_size, score_mod and mask_mod: as in ``dot_product_attention``."""
    name = framework_of_call(
        queries=queries, keys=keys, values=values, valid_lens=valid_lens, W_q=W_q, W_k=W_k, w_v=w_v,
        attention_mask=attention_mask,
    )  # fmt: skip
    return get_backend(name).additive_attention(
        queries, keys, values, valid_lens, W_q=W_q, W_k=W_k, w_v=w_v, attention_mask=attention_mask,
        causal=causal, return_weights=return_weights, block_size=block_size, score_mod=score_mod,
        mask_mod=mask_mod,
        **unknown,
    )  # fmt: skip


def multi_head_attention(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    weights: Any,
    num_heads: int,
    attention_mask: Any = None,
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
    """Multi-head attention (d2l 11.5) on the framework of the arguments, with the canonical
    weights W_q (h, query_size), W_k (h, key_size), W_v (h, value_size), W_o (h, h) and,
    optionally, b_q, b_k, b_v, b_o (h,).  With ``return_weights=True`` returns
    ``(output (B, Q, h), attention_weights (B, num_heads, Q, K))``.  ``num_kv_heads``:
    grouped-query attention (W_k, W_v, b_k, b_v of num_kv_heads * h / num_heads rows).
    ``scale``: of each head's q k^T (None: 1 / sqrt(h / num_heads)).  ``block_mask`` and
    ``query_offset``: as in ``dot_product_attention``."""
    module = loaded_backend_of(queries, keys, values, valid_lens, attention_mask) or get_backend(
        framework_of_call(
            queries=queries, keys=keys, values=values, valid_lens=valid_lens, attention_mask=attention_mask
        )
    )
    return module.multi_head_attention(
        queries, keys, values, valid_lens, weights=weights, num_heads=num_heads,
        attention_mask=attention_mask, causal=causal, return_weights=return_weights,
        block_size=block_size, score_mod=score_mod, mask_mod=mask_mod, num_kv_heads=num_kv_heads,
        scale=scale, block_mask=block_mask, query_offset=query_offset,
        **unknown,
    )  # fmt: skip


def create_block_mask(
    mask_mod: Any = None,
    *,
    batch: int,
    q_len: int,
    kv_len: int,
    causal: bool = False,
    valid_lens: Any = None,
    attention_mask: Any = None,
    block_size: Any = None,
    like: Any,
) -> Any:
    """Every mask of calls with ``batch`` sequences of ``q_len`` queries over ``kv_len`` keys
    as one value, for ``block_mask=`` (FlexAttention's ``create_block_mask``): made once,
    reused by every call and layer; the calls give what passing the same masks gives.  The
    masks are normalised (causal beside a mask function that implies it, lengths that hide
    no key: dropped) and, per block size, which key blocks each query block visits is
    computed once.  ``like``: a tensor of the framework (and device) of the calls;
    ``block_size``: the calls' (None: automatic)."""
    from . import block_mask

    name = framework_of_call(like=like, valid_lens=valid_lens, attention_mask=attention_mask)
    return block_mask.create(
        get_backend(name).ops, mask_mod, batch, q_len, kv_len, causal, valid_lens, attention_mask, block_size
    )


def combine_attention(parts: Any) -> Any:
    """``(output, lse)`` of attention over the union of disjoint key sets, exactly, from each
    set's ``(output, lse)`` as ``dot_product_attention(..., return_lse=True)`` gives them
    (ring attention's merge): lse = log sum_i exp(lse_i), output = sum_i exp(lse_i - lse)
    output_i.  A part whose row sees nothing (lse -inf) adds nothing; a row no part sees is
    0 with lse -inf.  On the framework of the arguments."""
    from . import functional

    try:
        tensors = {f"parts[{i}][{j}]": x for i, part in enumerate(parts) for j, x in enumerate(part)}
    except TypeError:
        raise TypeError(
            f"parts must be a sequence of (output, lse) pairs, got {type(parts).__name__}"
        ) from None
    if not tensors:
        raise ValueError("parts must hold at least one (output, lse) pair, got none")
    return functional.combine_attention(get_backend(framework_of_call(**tensors)).ops, parts)


def _selected_module() -> ModuleType:
    return get_backend(_selected_backend())


def __getattr__(attr: str) -> Any:
    # The layer classes resolve at use, so MULTIATTN_BACKEND is read then, not at import.
    if attr in ("AdditiveAttention", "DotProductAttention", "MultiHeadAttention"):
        module = _selected_module()
        if not hasattr(module, attr):
            raise AttributeError(
                f"the {module.ops.name} backend has no layer classes (functions only: "
                "multiattn.masked_softmax, dot_product_attention, additive_attention, "
                "multi_head_attention); "
                f"choose a framework's backend with {ENV_VAR}"
            )
        return getattr(module, attr)
    raise AttributeError(f"module 'multiattn' has no attribute {attr!r}")
