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
    "flex_attention",
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
    """Softmax over X's last axis (d2l's ``masked_softmax``), on X's framework, with hidden
    positions exactly 0 and a row that sees nothing all 0 (never NaN).

    X: scores (B, Q, K) or (B, H, Q, K), a floating tensor; the result has its shape and dtype.
    valid_lens: (B,) one length per sequence, or (B, Q) one per query row; key j is hidden
    where j >= the length (ints, or floats as d2l allows).
    attention_mask: booleans broadcastable to X, True where the query may attend (torch
    SDPA's polarity; Hugging Face's 0/1 mask as ``mask.bool()``).
    causal: hide key j from query i where j > i (top-left: row i sees keys 0..i).
    mask_mod(b, h, q_idx, kv_idx) -> booleans, True: may attend; ANDed with the others.
    score_mod(score, b, h, q_idx, kv_idx) -> scores: applied to X first (``multiattn.mods``).
    """
    module = _backend_of(X=X, valid_lens=valid_lens, attention_mask=attention_mask)
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
    """softmax(scale Q K^T) V with masking (d2l's scaled dot-product attention), on the
    framework of the arguments; a query that sees no key gets 0 (never NaN).

    queries: (B, Q, d) or, torch SDPA's layout, (B, H, Q, d).
    keys, values: (B, K, d), (B, K, v) or (B, H_kv, K, .), H_kv dividing H: query head i
    uses key/value head i // (H / H_kv) (grouped-query attention, never repeated in memory).
    valid_lens: (B,) one length per sequence, or (B, Q) one per query row: key j is hidden
    where j >= the length.
    attention_mask: booleans broadcastable to the scores (B, [1|H,] Q, K), True where the
    query may attend (torch SDPA's polarity; Hugging Face's 0/1 mask as ``mask.bool()``).
    causal: hide key j from query i where j > i + query_offset (top-left aligned: with fewer
    queries than keys and no offset, row i sees keys 0..i; a decoding step's queries after
    K - Q cached keys: ``query_offset=K - Q``).
    return_weights: also return the weights (B, [H,] Q, K); return_lse: also (last) lse
    (B, [H,] Q), the natural log of the sum of exp of each row's visible scores (-inf where
    none is), for ``combine_attention``.
    block_size: without the weights, the scores in blocks of this many queries and keys
    (None: automatically, where they would not fit; linear memory).
    score_mod(score, b, h, q_idx, kv_idx): on the scaled scores; mask_mod(b, h, q_idx,
    kv_idx): True where the query may attend, ANDed with the masks (``multiattn.mods``).
    scale: of Q K^T (None: 1 / sqrt(d)).
    block_mask: every mask as one value (``create_block_mask``), instead of the mask
    arguments.
    query_offset: query row i sits at position query_offset + i (an int, or (B,) ints), after
    the keys of a cache: causal and the mods see those positions (docs/decoding.md).
    """
    module = _backend_of(
        queries=queries, keys=keys, values=values, valid_lens=valid_lens, attention_mask=attention_mask
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
    """Additive attention (d2l 11.3): a(q, k) = w_v^T tanh(W_q q + W_k k), on the framework of
    the arguments; a query that sees no key gets 0.

    queries (B, Q, query_size), keys (B, K, key_size), values (B, K, v).
    W_q (num_hiddens, query_size), W_k (num_hiddens, key_size), w_v (num_hiddens,): the
    canonical layout (d2l's y = W x).
    valid_lens, attention_mask (True: may attend), causal (top-left), return_weights,
    block_size, score_mod, mask_mod: as in ``dot_product_attention``."""
    module = _backend_of(
        queries=queries, keys=keys, values=values, valid_lens=valid_lens, W_q=W_q, W_k=W_k, w_v=w_v,
        attention_mask=attention_mask,
    )  # fmt: skip
    return module.additive_attention(
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
    """Multi-head attention (d2l 11.5) on the framework of the arguments.

    queries (B, Q, query_size), keys (B, K, key_size), values (B, K, value_size).
    weights: a mapping of the canonical weights W_q (h, query_size), W_k (h, key_size),
    W_v (h, value_size), W_o (h, h) and, optionally, b_q, b_k, b_v, b_o (h,) (y = W x + b).
    num_heads: h / num_heads features per head; num_kv_heads: grouped-query attention (W_k,
    W_v, b_k, b_v of num_kv_heads * h / num_heads rows).
    valid_lens ((B,) or (B, Q)), attention_mask (True: may attend), causal (top-left,
    j > i + query_offset hidden), block_size, score_mod, mask_mod, block_mask, query_offset:
    as in ``dot_product_attention``; scale: of each head's q k^T (None: 1 / sqrt(h /
    num_heads)).  With ``return_weights=True`` returns ``(output (B, Q, h), weights (B,
    num_heads, Q, K))``, else the output."""
    module = _backend_of(
        queries=queries, keys=keys, values=values, valid_lens=valid_lens, attention_mask=attention_mask
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
    B: Any = None,
    H: Any = None,
    Q_LEN: Any = None,
    KV_LEN: Any = None,
    device: Any = None,
    BLOCK_SIZE: Any = None,
    *,
    batch: Any = None,
    q_len: Any = None,
    kv_len: Any = None,
    causal: bool = False,
    valid_lens: Any = None,
    attention_mask: Any = None,
    block_size: Any = None,
    like: Any = None,
) -> Any:
    """Every mask of calls with ``B`` sequences (``batch=``) of ``Q_LEN`` queries (``q_len=``)
    over ``KV_LEN`` keys (``kv_len=``) as one value, for ``block_mask=`` of
    ``dot_product_attention``, ``multi_head_attention`` and ``flex_attention``: made once,
    reused by every call and layer; a call gives what passing the same masks gives.

    FlexAttention's form works as it is: ``create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)``
    (B None: any batch; H None or a head count: the calls' heads; ``device`` is ignored, the
    tensors of the calls place the mask; ``BLOCK_SIZE``: an int, or (q, kv) of one size).
    ``mask_mod(b, h, q_idx, kv_idx)``: True where the query may attend (``multiattn.mods``);
    ``causal``, ``valid_lens`` and ``attention_mask`` (True: may attend) as in
    ``dot_product_attention``.  ``like``: a tensor of the calls' framework; without it and
    without mask tensors the mask binds to the framework of its first call.  The masks are
    normalised (causal beside a mask function that implies it, lengths that hide no key:
    dropped) and, per block size, which key blocks each query block visits is computed once."""
    from . import block_mask

    sizes = block_mask.flex_sizes(B, H, Q_LEN, KV_LEN, BLOCK_SIZE, batch, q_len, kv_len, block_size)
    ops = None
    if like is not None or valid_lens is not None or attention_mask is not None:
        ops = _backend_of(like=like, valid_lens=valid_lens, attention_mask=attention_mask).ops
    return block_mask.create(ops, mask_mod, *sizes, causal, valid_lens, attention_mask)


def flex_attention(
    query: Any,
    key: Any,
    value: Any,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: Any = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Any = None,
    *,
    return_aux: Any = None,
) -> Any:
    """FlexAttention's call (``torch.nn.attention.flex_attention.flex_attention``) on every
    framework: query (B, H, Q, E), key (B, H_kv, K, E), value (B, H_kv, K, Ev) of one
    framework; ``score_mod(score, b, h, q_idx, kv_idx)`` on the scaled scores;
    ``block_mask`` from ``create_block_mask`` (None: every key visible); ``scale`` (None:
    1 / sqrt(E)); ``enable_gqa``: H_kv may divide H (query head h uses key/value head
    h // (H / H_kv)).  Returns the output (B, H, Q, Ev), and with ``return_lse=True`` (or
    ``return_aux`` asking for lse) also the natural-log lse (B, H, Q).  A query that sees
    no key gets output 0 and lse -inf.  ``kernel_options`` is accepted and ignored (it
    tunes torch's kernel)."""
    from . import block_mask as flex

    want_lse = flex.check_flex_call(query, key, value, enable_gqa, return_lse, kernel_options, return_aux)
    result = dot_product_attention(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, return_lse=want_lse
    )
    if return_aux is not None:
        return (result[0], flex.AuxOutput(lse=result[1])) if want_lse else (result, flex.AuxOutput())
    return result


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
    return functional.combine_attention(_backend_of(**tensors).ops, parts)


def _backend_of(**tensors: Any) -> ModuleType:
    """The backend module of the tensors' framework (TypeError where they mix frameworks)."""
    first = next(iter(tensors.values()))
    if type(first).__module__.startswith("torch"):
        # a static import before the registry is read: torch.compile traces it (not importlib)
        # on a first call in a fresh process; at later calls it costs a lookup
        from .backends import torch as _  # noqa: F401
    module = loaded_backend_of(*tensors.values())
    return module if module is not None else get_backend(framework_of_call(**tensors))


def __dir__() -> list:
    return sorted(__all__ + ["__version__"])


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
