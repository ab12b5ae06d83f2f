"""Attention past one machine: dask arrays chunked along the batch, the queries and the keys,
one task per (batch, query, key) chunk.

For key chunks C_1, ..., C_n (disjoint, together all the keys) each chunk gives, over its
visible keys, the partial output and log-sum-exp of its scores s_ij = q_i . k_j / sqrt(d),

    out_c = sum_{j in C_c} softmax_c(s_ij) v_j,      lse_c = log sum_{j in C_c} exp(s_ij),

and the attention over all the keys is exactly (``multiattn.combine_attention``)

    lse = log sum_c exp(lse_c),      out = sum_c exp(lse_c - lse) out_c.

That merge is associative, so the partials are merged by a tree reduction of
``split_every`` partials a node (``dask.array.reduction``): depth log_split_every(n).  A chunk
starting at key offset o keeps the masks exact by lengths: key j of the chunk is key o + j,
visible where o + j < valid_len, and, causal, where o + j <= i (query i), i.e. its lengths
are min(valid_lens - o, i + 1 - o); score and mask functions see absolute positions
(``mods.at_offset``, ``mods.score_at_offset``); a chunk no query sees is not computed.  Each
task computes with the in-memory path of the chunks' own backend (numpy's blocks), so a worker
needs numpy and multiattn only; a partial travels as one array (b, [h,] q, 1, v + 1), its lse
the last column.  ``dot_product_attention`` on dask arrays comes here (the array_api adapter's
offer, ``offer``); dask is imported at call.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

__all__ = ["attention_over_key_chunks"]


def attention_over_key_chunks(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    causal: bool = False,
    split_every: int = 4,
    block_size: Optional[int] = None,
) -> Tuple[Any, Any]:
    """(output (B, [H,] Q, v), lse (B, [H,] Q)) of dot-product attention, lazily, as dask arrays.

    queries (B, Q, d) may be chunked along the batch and the queries; keys (B, K, d) and
    values (B, K, v) are chunked along the keys axis K, with the same chunks (along the
    batch they follow the queries').  4-D as ``dot_product_attention``: queries (B, H, Q, d),
    keys and values (B, H_kv, K, .), H_kv dividing H (each task takes every head).
    valid_lens: None, (B,) or (B, Q), as in ``multiattn.dot_product_attention``; causal: key j
    visible to query i only where j <= i.
    Each (batch, query, key) chunk is one task giving a partial (output, lse); the partials
    of one (batch, query) chunk are merged exactly, ``split_every`` at a time.
    block_size: passed to each task's ``dot_product_attention`` (None: its automatic
    choice): a task then holds the scores of one (batch chunk, block_size, block_size) block.
    A row that sees no key is 0 with lse -inf, as in ``dot_product_attention``.
    """
    import dask.array as da

    import multiattn

    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if isinstance(split_every, bool) or not isinstance(split_every, int) or split_every < 2:
        raise ValueError(f"split_every must be an integer >= 2 (partials per merge), got {split_every!r}")
    queries, keys, values = (da.asarray(x) for x in (queries, keys, values))
    four = queries.ndim == 4
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        if x.ndim != queries.ndim or x.ndim not in (3, 4):
            axis = "queries" if name == "queries" else "keys"
            heads = "heads" if name == "queries" else "kv_heads"
            raise ValueError(
                f"{name} must be 3-D, (batch, {axis}, features), or 4-D, (batch, {heads}, {axis}, features), "
                f"like queries, got shape {x.shape}"
            )
        if any(np.isnan(size) for size in x.shape):
            raise ValueError(f"{name} has unknown chunk sizes {x.chunks}; call compute_chunk_sizes() first")
    B, (Q, d) = queries.shape[0], queries.shape[-2:]
    heads = (queries.shape[1], keys.shape[1]) if four else (1, 1)
    if keys.shape[0] != B or keys.shape[-1] != d or heads[0] % heads[1]:
        want = f"({B}, H_kv dividing {heads[0]}, K, {d})" if four else f"({B}, K, {d})"
        raise ValueError(
            f"keys must have shape {want} for queries of shape {queries.shape}, got {keys.shape}"
        )
    if values.shape[:-1] != keys.shape[:-1]:
        raise ValueError(
            f"values must have shape {keys.shape[:-1]} + (v,) for keys of shape {keys.shape}, "
            f"got {values.shape}"
        )
    if keys.chunks[-2] != values.chunks[-2]:
        raise ValueError(
            f"keys and values must have the same chunks along the keys axis (axis {keys.ndim - 2}): keys "
            f"{keys.chunks[-2]}, values {values.chunks[-2]}"
        )
    # a one-element call checks the dtypes and block_size now (multiattn's own errors), not in
    # the tasks
    probe = [np.zeros((1, 1, 1), x.dtype) for x in (queries, keys, values)]
    multiattn.dot_product_attention(*probe, return_lse=True, block_size=block_size)
    if valid_lens is not None:
        valid_lens = da.asarray(valid_lens)
        if valid_lens.shape not in ((B,), (B, Q)):
            raise ValueError(f"valid_lens must have shape ({B},) or ({B}, {Q}), got {valid_lens.shape}")
        if valid_lens.dtype.kind not in "iuf":
            raise TypeError(f"valid_lens must have an integer or float dtype, got {valid_lens.dtype}")
    return chunked(
        queries, keys, values, valid_lens, causal=causal, split_every=split_every, block_size=block_size
    )


def chunked(
    queries: Any, keys: Any, values: Any, valid_lens: Any = None, *, causal: bool = False,
    mask_mod: Any = None, score_mod: Any = None, scale: Optional[float] = None, split_every: int = 4,
    block_size: Optional[int] = None,
) -> Tuple[Any, Any]:  # fmt: skip
    """(output, lse) as dask arrays of checked dask arguments: one task per (batch, query, key)
    chunk, its partial state from the in-memory call of the chunks' backend, the masks and
    mods at the chunk's absolute positions; the partials merged by a tree reduction.  Where
    a score or mask function is given, each task takes the whole batch (they see its index)."""
    import dask.array as da

    from ._registry import framework_of, get_backend

    four = queries.ndim == 4
    Q, (K, v) = queries.shape[-2], values.shape[-2:]
    whole = {1: -1, 3: -1} if four else {2: -1}  # the heads and the features in every task
    if mask_mod is not None or score_mod is not None:
        whole[0] = -1
    queries = queries.rechunk(whole)
    batch_chunks, query_chunks = queries.chunks[0], queries.chunks[-2]
    keys = keys.rechunk({0: batch_chunks, **whole})
    values = values.rechunk({0: batch_chunks, values.ndim - 2: keys.chunks[-2], **whole})
    lens_args: Tuple[Any, Any] = (None, None)
    if valid_lens is not None:
        valid_lens = valid_lens.rechunk((batch_chunks, query_chunks)[: valid_lens.ndim])
        lens_args = (valid_lens, "bq"[: valid_lens.ndim])
    # the results' dtypes: those of the chunks' backend's call on one element of each
    backend = get_backend(framework_of(queries._meta) or "numpy")
    probe = [np.zeros((1, 1, 1), x.dtype) for x in (queries, keys, values)]
    out_dtype, lse_dtype = (np.dtype(x.dtype) for x in backend.dot_product_attention(*probe, return_lse=True))
    packed = np.result_type(out_dtype, lse_dtype)
    query_positions = da.arange(Q, chunks=(query_chunks,))  # a task reads its chunk's offsets
    key_positions = da.arange(K, chunks=(keys.chunks[-2],))
    h, g = ("h", "g") if four else ("", "")  # query heads, key/value heads (grouped: fewer)
    partials = da.blockwise(
        _partial, f"b{h}qkz",
        queries, f"b{h}qd", keys, f"b{g}kd", values, f"b{g}ke", query_positions, "q", key_positions, "k",
        *lens_args,
        new_axes={"z": v + 1}, adjust_chunks={"k": 1}, concatenate=True, token="attention-of-a-key-chunk",
        dtype=packed, meta=np.empty((0,) * (queries.ndim + 1), packed),
        causal=causal, block_size=block_size, packed=packed, mask_mod=mask_mod, score_mod=score_mod,
        scale=scale,
    )  # fmt: skip
    merged = da.reduction(
        partials, _as_is, _merge, combine=_merge, axis=queries.ndim - 1, keepdims=False,
        split_every=split_every, dtype=packed, meta=np.empty((0,) * queries.ndim, packed), concatenate=True,
        name="attention-over-key-chunks",
    )  # fmt: skip
    return merged[..., :v].astype(out_dtype), merged[..., v].astype(lse_dtype)


def offer(
    queries: Any, keys: Any, values: Any, masks: Any, scale: float, score_mod: Any, block_size: Any
) -> Any:
    """``Specialisations.attend_over_chunks`` for dask arrays: a function giving (output, lse)
    by ``chunked``, or why it declines."""
    if not all(type(x).__module__.startswith("dask.") for x in (queries, keys, values)):
        return "not dask arrays"  # (dask, where it is not installed, is not imported)
    import dask.array as da

    if masks.attention_mask is not None:
        return "a boolean attention_mask: its chunks would follow the scores' (the block loop takes it)"
    if any(np.isnan(size) for x in (queries, keys, values) for size in x.shape):
        return "unknown chunk sizes"
    lens = None if masks.valid_lens is None else da.asarray(masks.valid_lens)
    return lambda: chunked(
        queries, keys, values, lens, causal=masks.causal, mask_mod=masks.mask_mod, score_mod=score_mod,
        scale=scale, block_size=block_size,
    )  # fmt: skip


def _partial(
    q, k, v, q_pos, k_pos, lens, *, causal: bool, block_size: Optional[int], packed, mask_mod, score_mod,
    scale,
) -> np.ndarray:  # fmt: skip
    """One key chunk's (output, lse), packed as (b, [h,] q, 1, v + 1) of dtype packed: lse the last
    column."""
    from . import core, mods
    from ._registry import framework_of, get_backend
    from .masks import Masks

    q_offset = int(q_pos[0]) if len(q_pos) else 0
    offset = int(k_pos[0]) if len(k_pos) else 0
    lengths = None
    if lens is not None:  # in int64 or float64: lens - offset must not wrap or overflow
        lengths = lens.astype(np.float64 if lens.dtype.kind == "f" else np.int64) - offset
    if causal:
        by_position = (q_pos.astype(np.int64) + 1 - offset)[None, :]  # o + j <= i: j < i + 1 - o
        if lengths is None:
            lengths = np.broadcast_to(by_position, (q.shape[0], q.shape[-2]))
        else:
            lengths = np.minimum(lengths if lengths.ndim == 2 else lengths[:, None], by_position)
    mod = None if mask_mod is None else mods.at_offset(mask_mod, q_offset, offset)
    hidden = lengths is not None and not (lengths > 0).any()
    if mod is not None and not hidden:
        seen = mod.key_range(0, q.shape[-2])
        hidden = seen is not None and (seen[1] <= 0 or seen[0] >= k.shape[-2])
    if hidden:  # nothing in this chunk is visible
        out, lse = np.zeros(q.shape[:-1] + v.shape[-1:], packed), np.full(q.shape[:-1], -np.inf, packed)
    else:  # the in-memory call of the chunks' backend (numpy, or the array type they hold)
        name = framework_of(q) or "numpy"
        backend = get_backend(name)
        if lengths is not None and name != "numpy":
            lengths = backend.ops.constant(np.ascontiguousarray(lengths), q)
        smod = None if score_mod is None else mods.score_at_offset(score_mod, q_offset, offset)
        out, _, lse = core.dot_product_attention(
            backend.ops, q, k, v, Masks(lengths, None, False, mod), scale=scale, need_weights=False,
            block_size=block_size, need_lse=True, score_mod=smod,
        )  # fmt: skip
        if name != "numpy":
            out, lse = backend.to_numpy(out), backend.to_numpy(lse)
    return _pack(out, lse, packed)[..., None, :]


def _pack(out: np.ndarray, lse: np.ndarray, dtype) -> np.ndarray:
    return np.concatenate([out.astype(dtype, copy=False), lse.astype(dtype, copy=False)[..., None]], -1)


def _as_is(x: np.ndarray, axis: Any = None, keepdims: bool = True) -> np.ndarray:
    return x


def _merge(x: np.ndarray, axis: Any = None, keepdims: bool = True) -> np.ndarray:
    """The exact merge of the partials x (b, [h,] q, n, v + 1) along axis -2 (combine_attention)."""
    import multiattn

    parts = [(x[..., i, :-1], x[..., i, -1]) for i in range(x.shape[-2])]
    out, lse = multiattn.combine_attention(parts) if len(parts) > 1 else parts[0]
    merged = _pack(out, lse, x.dtype)
    return merged[..., None, :] if keepdims else merged
