"""Attention past one machine along the keys: dask arrays chunked along the keys axis.

For key chunks C_1, ..., C_n (disjoint, together all the keys) each chunk gives, over its
visible keys, the partial output and log-sum-exp of its scores s_ij = q_i . k_j / sqrt(d),

    out_c = sum_{j in C_c} softmax_c(s_ij) v_j,      lse_c = log sum_{j in C_c} exp(s_ij),

and the attention over all the keys is exactly (``multiattn.combine_attention``)

    lse = log sum_c exp(lse_c),      out = sum_c exp(lse_c - lse) out_c.

That merge is associative, so the partials are merged by a tree reduction of
``split_every`` partials a node (``dask.array.reduction``): depth log_split_every(n).  A chunk
starting at key offset o keeps the masks exact by lengths: key j of the chunk is key o + j,
visible where o + j < valid_len, and, causal, where o + j <= i (query i), i.e. its lengths
are min(valid_lens - o, i + 1 - o); a chunk no query sees is not computed.  Each task
computes on numpy blocks with multiattn's numpy backend, so a worker needs numpy and
multiattn only; a partial travels as one array (b, [h,] q, 1, v + 1), its lse the last column.
dask is imported at call.
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
    (B, Q, d), (K, v) = (queries.shape[0],) + queries.shape[-2:], values.shape[-2:]
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
    # the tasks, and gives the results' dtypes
    probe = [np.zeros((1, 1, 1), x.dtype) for x in (queries, keys, values)]
    probe = multiattn.dot_product_attention(*probe, return_lse=True, block_size=block_size)
    out_dtype, lse_dtype = probe[0].dtype, probe[1].dtype
    packed = np.result_type(out_dtype, lse_dtype)
    batch_chunks, query_chunks = queries.chunks[0], queries.chunks[-2]
    whole = {1: -1, 3: -1} if four else {2: -1}  # the heads and the features in every task
    queries = queries.rechunk(whole)
    keys = keys.rechunk({0: batch_chunks, **whole})
    values = values.rechunk({0: batch_chunks, **whole})
    lens_args: Tuple[Any, Any] = (None, None)
    if valid_lens is not None:
        valid_lens = da.asarray(valid_lens)
        if valid_lens.shape not in ((B,), (B, Q)):
            raise ValueError(f"valid_lens must have shape ({B},) or ({B}, {Q}), got {valid_lens.shape}")
        if valid_lens.dtype.kind not in "iuf":
            raise TypeError(f"valid_lens must have an integer or float dtype, got {valid_lens.dtype}")
        valid_lens = valid_lens.rechunk((batch_chunks, query_chunks)[: valid_lens.ndim])
        lens_args = (valid_lens, "bq"[: valid_lens.ndim])
    query_positions = da.arange(Q, chunks=(query_chunks,))
    key_positions = da.arange(K, chunks=(keys.chunks[-2],))  # a task reads its chunk's offset
    h, g = ("h", "g") if four else ("", "")  # query heads, key/value heads (grouped: fewer)

    partials = da.blockwise(
        _partial, f"b{h}qkz",
        queries, f"b{h}qd", keys, f"b{g}kd", values, f"b{g}ke", query_positions, "q", key_positions, "k",
        *lens_args,
        new_axes={"z": v + 1}, adjust_chunks={"k": 1}, concatenate=True, token="attention-of-a-key-chunk",
        dtype=packed, meta=np.empty((0,) * (queries.ndim + 1), packed),
        causal=causal, block_size=block_size, packed=packed,
    )  # fmt: skip
    merged = da.reduction(
        partials, _as_is, _merge, combine=_merge, axis=queries.ndim - 1, keepdims=False,
        split_every=split_every, dtype=packed, meta=np.empty((0,) * queries.ndim, packed), concatenate=True,
        name="attention-over-key-chunks",
    )  # fmt: skip
    return merged[..., :v].astype(out_dtype), merged[..., v].astype(lse_dtype)


def _partial(q, k, v, q_pos, k_pos, lens, *, causal: bool, block_size: Optional[int], packed) -> np.ndarray:
    """One key chunk's (output, lse), packed as (b, [h,] q, 1, v + 1) of dtype packed: lse the last
    column."""
    import multiattn

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
    if lengths is not None and not (lengths > 0).any():  # nothing in this chunk is visible
        out, lse = np.zeros(q.shape[:-1] + v.shape[-1:], packed), np.full(q.shape[:-1], -np.inf, packed)
    else:
        out, lse = multiattn.dot_product_attention(q, k, v, lengths, return_lse=True, block_size=block_size)
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
