"""What hides a key from a query: one value from the public API to the core (``Masks``),
and the boolean masks the core's steps make of it (``visibility``)."""

from __future__ import annotations

from typing import Any, Optional

from . import heads

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
    parts = []
    if masks.valid_lens is not None:
        parts.append(ops.length_mask(like if scores is not None else keys, masks.valid_lens, axis=key_axis))
    if masks.attention_mask is not None:
        parts.append(masks.attention_mask)
    if masks.causal:
        parts.append(ops.causal_mask(n_queries, n_keys, like))
    return all_of(ops, parts, rank)


def all_of(ops: Ops, masks: list, rank: int) -> Optional[Tensor]:
    """The AND of boolean masks, each brought to the scores' rank: a 3-D mask against 4-D
    scores is (B, Q, K), shared by the heads; smaller masks broadcast from the right."""
    combined = None
    for mask in masks:
        mask_rank = len(ops.shape(mask))
        if mask_rank == 3 and rank == 4:
            mask, mask_rank = ops.expand_dims(mask, 1), 4
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
