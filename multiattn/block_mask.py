"""Every mask of a call as one value, made once and reused by every layer of a model:
FlexAttention's ``BlockMask`` (``create_block_mask``), on every framework.

A ``BlockMask`` holds the masks, normalised (a mask function that implies causality drops
``causal``; lengths that hide no key are dropped), and, per block size, the block map: for each
query block the key blocks to visit (``block_loop.BlockMap``, and the block plan's answers),
computed on the first call that needs them and kept.  ``block_mask=bm`` on a call gives what
passing the same masks gives.
"""

from __future__ import annotations

from typing import Any, Optional

from . import validation
from .masks import Masks

Tensor = Any


class BlockMask:
    """The masks of calls with ``batch`` sequences of ``q_len`` queries over ``kv_len`` keys on
    one backend (``multiattn.create_block_mask``), and their block maps once computed."""

    def __init__(
        self, ops: Any, masks: Masks, batch: int, q_len: int, kv_len: int, block_size: Optional[int]
    ) -> None:
        self.ops, self.masks, self.block_size = ops, masks, block_size
        self.shape = (batch, q_len, kv_len)
        self.maps: dict = {}  # block side -> block_loop.BlockMap
        self.shown: dict = {}  # (block side, heads, q0, q1) -> blockwise.Plan.shown's answer

    @property
    def valid_lens(self) -> Tensor:
        return self.masks.valid_lens

    @property
    def attention_mask(self) -> Tensor:
        return self.masks.attention_mask

    @property
    def causal(self) -> bool:
        return self.masks.causal

    @property
    def mask_mod(self) -> Any:
        return self.masks.mask_mod

    def block_map(self, block: int) -> Any:
        """The ``block_loop.BlockMap`` of this mask in blocks of side block, computed once."""
        found = self.maps.get(block)
        if found is None:
            from .block_loop import BlockMap

            found = self.maps[block] = BlockMap(self.ops, self.masks, self.shape[1], self.shape[2], block)
        return found

    def __repr__(self) -> str:
        batch, q_len, kv_len = self.shape
        parts = [f"batch={batch}", f"q_len={q_len}", f"kv_len={kv_len}"]
        if self.masks.valid_lens is not None:
            parts.append(f"valid_lens of shape {tuple(self.ops.shape(self.masks.valid_lens))}")
        if self.masks.attention_mask is not None:
            parts.append(f"attention_mask of shape {tuple(self.ops.shape(self.masks.attention_mask))}")
        if self.masks.causal:
            parts.append("causal=True")
        if self.masks.mask_mod is not None:
            parts.append(f"mask_mod={self.masks.mask_mod!r}")
        return f"BlockMask({', '.join(parts)}, block_size={self.block_size}, backend={self.ops.name!r})"


def create(
    ops: Any,
    mask_mod: Any,
    batch: Any,
    q_len: Any,
    kv_len: Any,
    causal: Any,
    valid_lens: Tensor,
    attention_mask: Tensor,
    block_size: Any,
) -> BlockMask:
    """``multiattn.create_block_mask`` on the backend of ops, its arguments checked."""
    for arg, size in (("batch", batch), ("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(size, bool) or not hasattr(size, "__index__") or size < 1:
            raise ValueError(f"create_block_mask's {arg} must be a positive int, got {size!r}")
    batch, q_len, kv_len = batch.__index__(), q_len.__index__(), kv_len.__index__()
    block_size = validation.check_block_size(block_size, False)
    if valid_lens is not None:
        validation.check_valid_lens(ops, valid_lens, batch, q_len)
    validation.check_causal(causal)
    rank = 0 if attention_mask is None else len(ops.shape(attention_mask))
    scores = (batch, None, q_len, kv_len) if rank == 4 else (batch, q_len, kv_len)  # heads: the calls'
    mask = validation.check_attention_mask(ops, attention_mask, scores)
    _, masks = validation.with_mods(None, mask_mod, Masks(valid_lens, mask, causal), (batch, q_len, kv_len))
    return BlockMask(ops, masks.without_idle_lengths(ops, kv_len), batch, q_len, kv_len, block_size)


def unpacked(
    block_mask: Any,
    ops: Any,
    queries: Tensor,
    keys: Tensor,
    valid_lens: Tensor,
    attention_mask: Tensor,
    causal: Any,
    mask_mod: Any,
    block_size: Any,
    weights: bool,
) -> tuple:
    """(valid_lens, attention_mask, causal, mask_mod, block_size) of a call: its own where
    block_mask is None, else the block mask's (its block size where the call gives none and
    wants no weights), after checking that the call gives no masks of its own and that its
    batch, queries and keys are the block mask's."""
    if block_mask is None:
        return valid_lens, attention_mask, causal, mask_mod, block_size
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            "block_mask must be a multiattn.create_block_mask(...) value, got "
            f"{type(block_mask).__module__}.{type(block_mask).__name__}"
        )
    given = dict(valid_lens=valid_lens, attention_mask=attention_mask, causal=causal, mask_mod=mask_mod)
    also = [name for name, value in given.items() if value is not None and value is not False]
    if also:
        raise ValueError(
            f"block_mask holds the call's masks: pass {', '.join(also)} to create_block_mask, not beside "
            "block_mask"
        )
    if block_mask.ops.name != ops.name:
        raise TypeError(f"block_mask was made for {block_mask.ops.name} tensors, the call's are {ops.name}'s")
    q_shape, k_shape = ops.shape(queries), ops.shape(keys)
    call = (q_shape[0], q_shape[-2], k_shape[-2])
    if any(got is not None and got != want for got, want in zip(call, block_mask.shape)):
        raise ValueError(
            f"block_mask was made for (batch, q_len, kv_len) = {block_mask.shape}, the call has {call}"
        )
    masks = block_mask.masks
    size = block_mask.block_size if block_size is None and not weights else block_size
    return masks.valid_lens, masks.attention_mask, masks.causal, masks.mask_mod, size
