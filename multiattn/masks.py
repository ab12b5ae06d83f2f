"""What hides a key from a query: one value from the public API to the core (``Masks``),
and the boolean masks the core's steps make of it (``visibility``)."""

from __future__ import annotations

from typing import Any, Optional

from . import heads, mods

Tensor = Any
Ops = Any  # adapter.Ops


class Masks:
    """Lengths (B,) or (B, Q) (key j visible for j < length), a boolean mask broadcastable to
    the scores (True: may attend), causality (key j visible from query i for j <= i), a mask
    function (``mods.MaskFunction``); a key is visible only where all of them allow it.  Built
    by ``validation.gather_masks``; what the steps ask of it is answered once, here (``none``,
    ``only_lengths``, ``one_length_per_sequence``: lengths alone, one per sequence (B,), so
    that every query of a sequence sees the same keys)."""

    __slots__ = (
        "valid_lens", "attention_mask", "causal", "mask_mod",
        "none", "only_lengths", "one_length_per_sequence", "block_mask",
    )  # fmt: skip

    def __init__(
        self,
        valid_lens: Tensor = None,
        attention_mask: Tensor = None,
        causal: bool = False,
        mask_mod: Any = None,
        block_mask: Any = None,
    ) -> None:
        self.valid_lens, self.attention_mask, self.causal = valid_lens, attention_mask, causal
        self.mask_mod = mask_mod
        self.block_mask = block_mask  # the ``BlockMask`` they came from, whose block maps are kept
        others = attention_mask is not None or causal or mask_mod is not None
        self.none = valid_lens is None and not others
        self.only_lengths = valid_lens is not None and not others
        self.one_length_per_sequence = self.only_lengths and len(valid_lens.shape) == 1

    def __repr__(self) -> str:
        lens, mask = self.valid_lens, self.attention_mask
        mod = "" if self.mask_mod is None else f", mask_mod={self.mask_mod!r}"
        return f"Masks(valid_lens={lens!r}, attention_mask={mask!r}, causal={self.causal}{mod})"

    def with_mask_mod_evaluated(self, ops: Ops, like: Tensor, shape: Optional[tuple] = None) -> "Masks":
        """These masks with the mask function's booleans for every (query, key) of scores of
        shape (B, [H,] Q, K) (default: like's, a tensor on their device) ANDed into
        attention_mask: what every path but the blocks takes."""
        if self.mask_mod is None:
            return self
        shape = tuple(ops.shape(like)) if shape is None else shape
        heads = shape[1] if len(shape) == 4 else None
        found = self.mask_mod.values(ops, like, heads, (0, shape[-2], 0, shape[-1]), shape[0])
        if self.attention_mask is not None:
            found = all_of(ops, [self.attention_mask, found], len(shape))
        return Masks(self.valid_lens, found, self.causal)

    def with_block_mask(self, block_mask: Any) -> "Masks":
        """These masks, made by block_mask (None: as they are): its block maps serve them."""
        if block_mask is None:
            return self
        return Masks(self.valid_lens, self.attention_mask, self.causal, self.mask_mod, block_mask)

    def without_idle_lengths(self, ops: Ops, n_keys: int) -> "Masks":
        """These masks without lengths that hide no key (every length > n_keys - 1), read on the
        host where the framework allows (never where traced): the blocks' plan and the fast
        kernels then see the other masks alone (causal's halves, SDPA's is_causal)."""
        host = None if self.valid_lens is None else ops.host_values(self.valid_lens)
        if host is None or not host.size or not (host > n_keys - 1).all():  # NaN: kept
            return self
        return Masks(None, self.attention_mask, self.causal, self.mask_mod, self.block_mask)


NO_MASKS = Masks()


# -- the masks as booleans, for the core's steps ------------------------------------------


def visibility(
    ops: Ops, masks: Masks, scores: Tensor = None, *, queries: Tensor = None, keys: Tensor = None
) -> Optional[Tensor]:
    """Which key each query may see, for scores (B, [H,] Q, K) (or, where there are none, a
    fused kernel's, for queries and keys): j < valid_len, attention_mask and (causal) j <= i,
    all of them (AND); None where every key is visible."""
    if masks.none:
        return None
    if masks.only_lengths and scores is not None:  # the common case in fewer steps
        mask = ops.length_mask(scores, masks.valid_lens)  # (B, 1|Q, K), shared by the heads
        return mask if len(ops.shape(scores)) == 3 else ops.expand_dims(mask, 1)
    if scores is not None:
        like, rank, (n_queries, n_keys), key_axis = scores, len(ops.shape(scores)), ops.shape(scores)[-2:], -1
    else:
        like, rank, key_axis = queries, len(ops.shape(queries)), -2
        n_queries, n_keys = ops.shape(queries)[-2], ops.shape(keys)[-2]
    return block_visibility(
        ops, like, 0, 0, n_queries, n_keys, rank=rank, valid_lens=masks.valid_lens,
        attention_mask=masks.attention_mask, causal=masks.causal, keys=like if scores is not None else keys,
        key_axis=key_axis,
    )  # fmt: skip


def block_visibility(
    ops: Ops, like: Tensor, q0: Any, k0: Any, n_queries: Any, n_keys: Any, *, rank: int,
    valid_lens: Tensor = None, attention_mask: Tensor = None, causal: bool = False, mask_mod: Any = None,
    heads: Optional[int] = None, batch: Any = None, mod_values: Tensor = None, limits: tuple = (None, None),
    keys: Tensor = None, key_axis: int = -2,
) -> Optional[Tensor]:  # fmt: skip
    """Which key each query may see in the block of queries q0 .. q0 + n_queries - 1 and keys
    k0 .. k0 + n_keys - 1, broadcastable to its scores (B, [H,] n_queries, n_keys) of rank
    rank: the lengths, the boolean mask, causality, the mask function (its booleans mod_values
    where already made), and limits (queries, keys): rows and columns at or past them hidden
    (a padded block's); None where every key is.  q0 and k0: ints, or scalar tensors where a
    compiled loop places the block (``ops.rows_at`` slices there); like: a tensor on the device;
    keys: a tensor whose axis key_axis holds the block's keys (where their number is traced)."""
    found, at_ints = [], isinstance(q0, int) and isinstance(k0, int)
    diagonal = causal and at_ints and q0 == k0  # key k0 + j, query q0 + i: j <= i
    key_pos = query_pos = None
    if (causal and not diagonal) or limits[1] is not None:
        key_pos = _positions(ops, k0, n_keys, like)
    if (causal and not diagonal) or limits[0] is not None:
        query_pos = ops.expand_dims(_positions(ops, q0, n_queries, like), -1)
    if limits[1] is not None:
        found.append(key_pos < limits[1])
    if limits[0] is not None:  # a padded query's score with a key of -inf is NaN: hidden
        found.append(query_pos < limits[0])
    if diagonal:
        found.append(ops.causal_mask(n_queries, n_keys, like))
    elif causal:
        found.append(key_pos <= query_pos)
    if valid_lens is not None:
        lens = valid_lens if len(ops.shape(valid_lens)) == 1 else _rows(ops, valid_lens, q0, n_queries, -1)
        keys = ops.zeros((n_keys, 1), like) if keys is None else keys
        found.append(ops.length_mask(keys, lens - _like(ops, k0, lens), axis=key_axis))
    if attention_mask is not None:
        mask, shape = attention_mask, ops.shape(attention_mask)
        if len(shape) > 1 and shape[-2] != 1:  # else broadcast
            mask = _rows(ops, mask, q0, n_queries, -2)
        if len(shape) > 0 and shape[-1] != 1:  # a mask function's scalar: broadcast
            mask = _rows(ops, mask, k0, n_keys, -1)
        found.append(mask)
    if mask_mod is not None and mod_values is None:
        sizes = (n_queries, n_keys)
        block = (q0, q0 + n_queries, k0, k0 + n_keys) if at_ints else mods.TracedBlock(q0, k0, sizes)
        mod_values = mask_mod.values(ops, like, heads, block, batch)
    if mod_values is not None:
        found.append(mod_values)
    return all_of(ops, found, rank)


def _positions(ops: Ops, start: Any, size: Any, like: Tensor) -> Tensor:
    """start .. start + size - 1: one op where start is an int."""
    if isinstance(start, int) and isinstance(size, int):
        return ops.positions(start, start + size, like)
    return ops.positions(0, size, like) + start


def _rows(ops: Ops, x: Tensor, start: Any, size: Any, axis: int) -> Tensor:
    """x's size entries from start along axis: a slice where start is an int (x itself where
    that is all of them)."""
    if isinstance(start, int):
        if start == 0 and ops.shape(x)[axis] == size:
            return x
        return x[(Ellipsis, slice(start, start + size)) + (slice(None),) * (-axis - 1)]
    return ops.rows_at(x, start, size, axis)


def _like(ops: Ops, k0: Any, lens: Tensor) -> Any:
    return k0 if isinstance(k0, int) else ops.cast(k0, lens)


def all_of(ops: Ops, masks: list, rank: int) -> Optional[Tensor]:
    """The AND of boolean masks, each brought to the scores' rank: a 3-D mask against 4-D
    scores is (B, Q, K), shared by the heads; smaller masks broadcast from the right."""
    combined = None
    for mask in masks:
        mask_rank = len(ops.shape(mask))
        if mask_rank == 3 and rank == 4:
            mask, mask_rank = ops.expand_dims(mask, 1), 4
        shape = tuple(ops.shape(mask))
        if mask_rank < rank and None not in shape:  # one reshape, not an op per axis
            mask, mask_rank = ops.reshape(mask, (1,) * (rank - mask_rank) + shape), rank
        while mask_rank < rank:
            mask, mask_rank = ops.expand_dims(mask, 0), mask_rank + 1
        combined = mask if combined is None else ops.logical_and(combined, mask)
    return combined


def visible_values(ops: Ops, values: Tensor, mask: Tensor) -> Tensor:
    """values (B, [H,] K, v) with the rows no query may see (mask (..., 1|Q, K) false for all
    of them) set to 0, so that a NaN or inf in the padding cannot reach the output as 0 * NaN.
    Values of grouped heads (``heads``) are seen by any query of their group's heads."""
    shape = ops.shape(mask)
    g = 1 if len(shape) == 3 else heads.groups(ops, mask, values)
    if g > 1:
        mask = heads.stacked(ops, mask, g)
        shape = ops.shape(mask)
    if shape[-2] != 1:  # per-query visibility: a key is used if any query sees it
        mask = ops.any(mask, -2)
    return ops.where(ops.matrix_transpose(mask), values, 0.0)  # (..., 1, K) -> (..., K, 1)
